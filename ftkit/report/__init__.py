"""Machine-readable reports of scenario results.

The JSON journal (``write_json_report`` / ``read_json_report``) is the format the other
reports and CI tooling read; ``environment_info`` describes where the results were obtained.
"""

from ftkit.report.journal import (
    REPORT_VERSION,
    environment_info,
    ftkit_version,
    read_json_report,
    report_dict,
    scenario_dict,
    summarize,
    write_json_report,
)

__all__ = [
    "REPORT_VERSION",
    "environment_info",
    "ftkit_version",
    "read_json_report",
    "report_dict",
    "scenario_dict",
    "summarize",
    "write_json_report",
]
