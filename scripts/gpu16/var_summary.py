"""One line per run of scripts/gpu16/var.sh (a folder VARIANT-sSEED-MODEL with bench_efficacy's results.json):
verdict, failed bars with their values, pooled and per-phrase held-out residual, g.kld, stop reason, max
violation, solve seconds, ‖ΔW‖/‖W‖. Usage: python3 scripts/gpu16/var_summary.py build/gpu16/out"""

import glob
import json
import os
import sys


def line(name: str, m: dict) -> str:
    if "solve_error" in m:
        return f"{name}\tREFUSED\t{m['solve_error'][:150]}"
    bars = m.get("bars") or {}
    failed = [f"{k}={b['value']:.4g}" if isinstance(b["value"], float) else k
              for k, b in bars.items() if b["applicable"] and b["passed"] is False]
    ho = m.get("heldout") or {}
    pooled = (ho.get("(all)") or {}).get("residual")
    pp = " ".join(f"{k[:10]}={v['residual']:.3f}" for k, v in ho.items()
                  if k != "(all)" and v.get("residual") is not None)
    conv = m.get("convergence") or {}
    return "\t".join(str(x) for x in (
        name, "PASS" if m.get("passed") else "FAIL", ",".join(failed) or "-",
        None if pooled is None else round(pooled, 3), pp, (bars.get("g.kld") or {}).get("value"),
        conv.get("stop_reason"), conv.get("max_violation"), m.get("solve_s"), m.get("dW_rel_norm")))


def main(out: str) -> None:
    print("run\tverdict\tfailed\tpooled\tper_phrase\tg.kld\tstop\tmaxviol\tsolve_s\tdW")
    for d in sorted(glob.glob(os.path.join(out, "*-s*-*"))):
        name, r = os.path.basename(d), os.path.join(d, "results.json")
        if not os.path.isfile(r):
            log = os.path.join(d, "log.txt")
            tail = open(log).read().strip().splitlines()[-2:] if os.path.isfile(log) else []
            print(f"{name}\tNORESULT\t{' | '.join(tail)[:200]}")
            continue
        for mm in json.load(open(r))["models"].values():
            print(line(name, mm["methods"].get("ftpo", {})))


if __name__ == "__main__":
    main(sys.argv[1])
