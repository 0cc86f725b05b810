"""Machine-readable and human-readable reports of scenario results.

The JSON journal (``write_json_report`` / ``read_json_report``) is the format the other
reports and CI tooling read; ``environment_info`` describes where the results were obtained.
``write_junit_report`` writes JUnit XML for CI test views, ``write_html_report`` one
self-contained HTML page with the verdict table and a fault timeline per scenario. Both take
either the results of a run or a journal loaded with ``read_json_report``. Every report shows
the fields the run overrode in every scenario (``ftkit run --set``).
"""

from ftkit.report.html import write_html_report
from ftkit.report.journal import (
    REPORT_VERSION,
    ReportContents,
    ReportSource,
    SkippedScenario,
    environment_info,
    ftkit_version,
    overrides_from_report,
    read_json_report,
    report_contents,
    report_dict,
    results_from_report,
    scenario_dict,
    skipped_from_report,
    summarize,
    write_json_report,
)
from ftkit.report.junit import write_junit_report
from ftkit.report.table import TABLE_COLUMNS, client_summary, table_cells, verdict_label

__all__ = [
    "REPORT_VERSION",
    "TABLE_COLUMNS",
    "ReportContents",
    "ReportSource",
    "SkippedScenario",
    "client_summary",
    "environment_info",
    "ftkit_version",
    "overrides_from_report",
    "read_json_report",
    "report_contents",
    "report_dict",
    "results_from_report",
    "scenario_dict",
    "skipped_from_report",
    "summarize",
    "table_cells",
    "verdict_label",
    "write_html_report",
    "write_json_report",
    "write_junit_report",
]
