"""``conveyor bench autoscale``'s pure parts: its command line and its progress lines (the
benchmark itself needs a cluster and prints figures; it is not run here)."""

from __future__ import annotations

import argparse

from conveyor.bench.autoscale.command import parse, parser
from conveyor.bench.autoscale.load import describe_status


def test_every_option_has_a_help_text_and_reaches_the_settings():
    options = [a for a in parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    s = parse(["--minutes", "1", "--step-factor", "3", "--progress-every", "5", "--keep"])
    assert (s.minutes, s.step_factor, s.progress_every_s, s.keep) == (1.0, 3.0, 5.0, True)


def test_a_progress_line_says_replicas_and_the_autoscalers_estimates():
    obj = {
        "spec": {"replicas": 3},
        "status": {
            "readyReplicas": 2,
            "autoscaler": {
                "direction": "up",
                "reason": "panic",
                "signals": {
                    "queueDepthPerReplica": 12.5,
                    "demandRequestsPerSecond": 16.7,
                    "utilization": 1.0,
                    "panic": True,
                },
                "capacity": {"requestsPerSecond": 8.35, "source": "measured"},
            },
        },
    }
    line = describe_status(obj)
    assert line == (
        "replicas 3 desired / 2 ready, queue/replica 12.5, demand 16.70 req/s, capacity "
        "8.35 req/s/replica (measured), utilization 1.00, panic, last decision up (panic)"
    )
    assert (
        describe_status({"spec": {"replicas": 1}})
        == "replicas 1 desired / 0 ready, queue/replica 0.0"
    )
