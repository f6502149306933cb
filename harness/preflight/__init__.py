"""`harness preflight`: prove before launch that every host can run the job (runner.py), and the gate a
launch passes before its nodes start (gates.py). The scripts it runs on hosts live in harness.node."""
