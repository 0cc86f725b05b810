"""Chaos search: ``ftkit explore`` generates scenarios from a seed, runs them on reused
engines, shrinks every failure to a minimal scenario file and counts what it covered.

::

    from ftkit.explore import Budget, Campaign, ExploreOptions, ExploreSpace
    result = Campaign(ExploreOptions(seed=1, budget=Budget.parse("5m"),
                                     space=ExploreSpace(tp=(1,)))).run()
    result.failures, result.coverage, result.to_dict()
"""

from ftkit.explore.campaign import (Budget, Campaign, CampaignEvent, ExploreOptions,
                                    coverage, idle_hosts, merge_subsumed, scenario_yaml)
from ftkit.explore.results import (CampaignResult, CoverageCell, ExploredRun, Failure,
                                   Outcome)
from ftkit.explore.space import (FEATURES, PHASES, ExploreSpace, features_of,
                                 model_prompt_tokens, parse_kinds, parse_names, scenarios)

__all__ = [
    "FEATURES",
    "PHASES",
    "Budget",
    "Campaign",
    "CampaignEvent",
    "CampaignResult",
    "CoverageCell",
    "ExploreOptions",
    "ExploreSpace",
    "ExploredRun",
    "Failure",
    "Outcome",
    "coverage",
    "features_of",
    "idle_hosts",
    "merge_subsumed",
    "model_prompt_tokens",
    "parse_kinds",
    "parse_names",
    "scenario_yaml",
    "scenarios",
]
