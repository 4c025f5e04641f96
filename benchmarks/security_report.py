"""`make reliability-security`: run tests/policy_server/test_security.py (real server
processes) and write its checks as docs/reliability/security.json, one record per check,
passed or not."""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.host import machine

# Test function (its name's stem) → (check, what it does against a real nightjar-server).
CHECKS = {
    "test_tcp_port_is_loopback_only_unless_widened": (
        "security: TCP on loopback by default",
        "--port alone, then --bind 0.0.0.0: listening addresses read from the kernel's "
        "socket table; the plaintext warning when widened",
    ),
    "test_mutual_tls_admits_only_clients_with_a_certificate_of_the_ca": (
        "security: mutual TLS",
        "--tls-cert/--tls-key/--tls-client-ca with a CA made by `cryptography`: a client "
        "certificate of the CA admitted (health, Decide, nightjarctl --tls-*); none, one of "
        "another CA, or plaintext refused",
    ),
    "test_tls_from_the_config_file_and_certificate_rotation": (
        "security: TLS from the TOML file, certificate rotation",
        "server TLS set in the config file; plaintext refused; the certificate replaced on "
        "disk while serving is presented to the next connection",
    ),
    "test_bad_tls_settings_stop_the_start_with_a_clear_error": (
        "security: bad TLS settings",
        "a certificate without key, a client CA without certificate, TLS without --port, "
        "missing files: exit 2 with a one-line error",
    ),
    "test_admin_token_file_is_reread_on_rotation": (
        "security: admin token rotation",
        "the token file renamed over, then rewritten in place, while the server runs: the old "
        "token refused, the new accepted; a placeholder refuses every mutating call",
    ),
    "test_restore_reads_no_file_outside_the_state_directory": (
        "security: Restore confined to the state directory",
        "Restore of an absolute path, ../, a symlink leading out, /etc/passwd, /dev/zero: "
        "PERMISSION_DENIED, state unchanged; a file inside restored",
    ),
    "test_path_parameters_are_confined_to_the_state_directory": (
        "security: path parameters confined",
        "prefill_cost_table outside the state directory through SwapPolicy, SetParameters "
        "and a restored snapshot_json: PERMISSION_DENIED, state unchanged; inside: loaded",
    ),
    "test_no_string_parameter_of_any_policy_reads_a_file_outside": (
        "security: every policy's string parameters",
        "each string parameter of each registered policy given a readable file outside the "
        "state directory: refused (PERMISSION_DENIED for paths, INVALID_ARGUMENT otherwise)",
    ),
    "test_no_parameter_makes_the_server_allocate_a_client_chosen_size": (
        "security: no client-sized allocation",
        "gamma_max / max_batch_size = 10^9, 100,000 table rows, 65,000 EMA steps, 10,000 "
        "tiers, a 5,000-digit seed: INVALID_ARGUMENT, state unchanged; every integer "
        "parameter of every policy at 10^9: refused, or accepted with RSS growth < 64 MiB "
        "and decisions going on",
    ),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("docs/reliability/security.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "tests/policy_server/test_security.py",
                f"--junitxml={junit}",
            ],
            check=False,
        )
        cases = ET.parse(junit).getroot().iter("testcase")
        results: dict[str, list[str]] = {name: [] for name in CHECKS}
        for case in cases:
            stem = case.get("name", "").split("[")[0]
            found = (case.find(tag) for tag in ("failure", "error", "skipped"))
            problem = next((p for p in found if p is not None), None)
            outcome = "" if problem is None else (problem.get("message") or "failed")[:200]
            results.setdefault(stem, []).append(outcome)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    host = machine()
    records = []
    for stem, outcomes in results.items():
        test, what = CHECKS.get(stem, (f"security: {stem}", stem))
        failed = [o for o in outcomes if o]
        passed = bool(outcomes) and not failed
        figure = (
            f"{len(outcomes) - len(failed)}/{len(outcomes)} cases passed" if outcomes else "not run"
        ) + (f"; first failure: {failed[0]}" if failed else "")
        records.append(
            {
                "test": test,
                "what": what,
                "figure": figure,
                "passed": passed,
                "date": date,
                "machine": host,
                "command": "make reliability-security",
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=2) + "\n")
    for r in records:
        print(f"{'PASS' if r['passed'] else 'FAIL'} {r['test']}: {r['figure']}")
    return 0 if all(r["passed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
