"""The rules file: promtool accepts it, and its unit tests fire and hold back each alert."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from conveyor.observability import rules
from conveyor.observability.prometheus import RULES_FILE

HERE = Path(__file__).parent


def test_every_alert_the_issue_asks_for_is_there() -> None:
    alerts = {r["alert"] for r in rules.alerting_rules()}
    assert alerts == {
        "ConveyorTTFTAboveTarget",
        "ConveyorKVCacheFull",
        "ConveyorQueueGrowingAtMaxReplicas",
        "ConveyorHighErrorRate",
        "ConveyorNoReadyReplica",
    }
    for rule in rules.alerting_rules():
        assert rule["for"] == "5m"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_promtool_check_rules_is_clean(promtool: Path) -> None:
    proc = subprocess.run(
        [str(promtool), "check", "rules", str(RULES_FILE)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = len(yaml.safe_load(RULES_FILE.read_text())["groups"][0]["rules"]) + len(
        rules.alerting_rules()
    )
    assert f"SUCCESS: {count} rules found" in proc.stdout


def test_promtool_unit_tests_fire_and_hold_back_each_alert(promtool: Path) -> None:
    test_file = HERE / "promtool" / "alerts_test.yaml"
    tested = {
        case["alertname"]
        for test in yaml.safe_load(test_file.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert tested == {r["alert"] for r in rules.alerting_rules()}, "an alert has no firing test"
    proc = subprocess.run(
        [str(promtool), "test", "rules", str(test_file)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
