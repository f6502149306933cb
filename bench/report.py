"""Results -> goals, a one-screen summary, and docs/benchmarks.md (generated; never edited by hand)."""

from __future__ import annotations

from typing import Any

from bench import stats

SEED_GOAL = 4.0  # payload (fast settings) / seed recipe, images/s, on an H100-class GPU
H100_GOAL = 60_000  # ResNet-18-CIFAR bf16 images/s on one H100
FAILURE_GOAL = 5.0  # seconds from a node's death to the last process of the job gone
LINEAR_GOAL = 0.25  # preflight over the most hosts: t(k) / (k * t(1)) at most this
HANG_MARGIN = 15.0  # a hang found within health.stall + this many seconds (issue 28)
STREAM_GOAL = 1.2  # a chatty job's stream against torchrun --tee 3 (issue 38)
WATCH_GOAL = 0.99  # the payload's img/s with the health watch on / off, at least this
SCALE_GROWTH = 1.5  # the controller's CPU per node at the most nodes, against the fewest (issue 49)
SCALE_CORES, SCALE_GIB, ANSWER_S = 1.0, 1.0, 1.0  # the controller at the most nodes; status and top
FLEET_GIB = 2.0  # the controller at 2,048 stand-in nodes x 8 ranks (issue 71)
KEPT_UP = 0.95  # the share of the ranks' lines a second the record must take to be keeping up
RECOVERY_GOALS = (3.0, 4.0)  # kill to the next first step: a lost rank on simulated nodes, a lost SSH host (issue 48)


def _ok(bench: dict[str, Any] | None) -> bool:
    return bench is not None and bool(bench) and "error" not in bench and "skipped" not in bench


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, each met (True), missed (False) or open (None: not measurable on this machine)."""
    b = result["benchmarks"]
    found: list[dict[str, Any]] = []
    tp = b.get("throughput")
    if _ok(tp):
        fast = next(r for r in tp["rows"] if r.get("fast"))
        gpu = tp["device"] != "cpu"
        found.append({"goal": f"payload >= {SEED_GOAL:g}x the seed recipe's img/s on an H100-class GPU",
                      "value": f"{fast['vs_seed']}x on {tp['device']} ({tp['model']}, batch {tp['batch_size']})",
                      "met": fast["vs_seed"] >= SEED_GOAL if gpu else None})
        h100 = gpu and ("H100" in tp["device"] or "H200" in tp["device"]) and tp["model"] == "resnet18"
        mfu = f", MFU {fast['mfu']:.1%}" if fast.get("mfu") is not None else ""
        found.append({"goal": f">= {H100_GOAL:,} img/s ResNet-18-CIFAR bf16 on one H100",
                      "value": f"{fast['images_per_s']:,.0f} img/s "
                               f"({tp['model']}, {fast['precision']}, batch {tp['batch_size']}, {tp['device']}{mfu})",
                      "met": fast["images_per_s"] >= H100_GOAL if h100 else None})
    fs = b.get("first_step")
    if _ok(fs) and "difference" in fs:  # results from before the rounds have medians alone
        found.append(_interval_goal(f"`harness launch` adds at most {fs['goal_s']:g} s to the first step, against "
                                    "torchrun by hand (2 nodes)", fs["difference"], fs["goal_s"]))
    if _ok(fs) and "trivial_difference" in fs:
        found.append(_interval_goal(f"`harness launch` adds at most {fs['trivial_goal_s']:g} s to a trivial job's "
                                    "whole run, against torchrun by hand", fs["trivial_difference"],
                                    fs["trivial_goal_s"]))
    hc = b.get("harness_cost")
    if _ok(hc):
        on_gpu = hc["device"] != "cpu"
        cost = _interval_goal(f"the harness costs the payload at most {1 - hc['goal_ratio']:.0%} of its img/s on a "
                              "GPU (harness launch / torchrun)", hc["ratio"], hc["goal_ratio"], at_most=False)
        if not on_gpu:  # on a CPU the harness's processes share the payload's cores: shown, not judged
            verdict = {True: "met", False: "missed", None: "undecided"}[cost["met"]]
            cost |= {"met": None, "value": f"{cost['value']} (on a CPU)", "open": "open (needs a GPU)",
                     "note": f"on this CPU the interval says {verdict}"}
        found.append(cost)
    pf = b.get("preflight")
    modes = pf.get("modes", ["full", "fast"]) if _ok(pf) else []
    if _ok(pf) and len(pf["rows"]) > 1:
        last = pf["rows"][-1]
        met = all(last[f"{mode}_vs_linear"] <= LINEAR_GOAL for mode in modes)
        names = {"full": "`harness preflight`", "fast": "fast checks"}
        found.append({
            "goal": f"preflight over k hosts grows far slower than linearly (t(k) <= {LINEAR_GOAL:g} x k x t(1))",
            "value": f"{last['hosts']} hosts: " + ", ".join(
                f"{names[mode]} {last[f'{mode}_vs_linear']} of linear ({_floor_ratio(last, mode, pf['cores'])} x "
                "the CPU floor)" for mode in modes),
            "met": met,
            "note": None if met else f"the {last['hosts']} simulated hosts share {pf['cores']} cores, so their own "
                                     "work is CPU-bound; a wall time near the CPU floor means no serialisation",
        })
    fp = b.get("failure")
    if _ok(fp):
        row = next(r for r in fp["rows"] if r["launcher"] == "harness launch" and r["block"] == "sleep")
        gone = row["all_gone_s"]
        found.append({"goal": f"every process of the job gone < {FAILURE_GOAL:g} s after a node dies",
                      "value": f"{gone} s" if gone is not None else "processes left",
                      "met": gone is not None and gone < FAILURE_GOAL})
    st = b.get("stream")
    if _ok(st):
        text = f"a chatty job's stream (terminal and record) within {STREAM_GOAL:g}x torchrun --tee 3"
        found.append(_interval_goal(text, st["paired_ratio"], STREAM_GOAL) if "paired_ratio" in st else
                     {"goal": text, "value": f"{st['ratio']:.3f}x", "met": st["ratio"] <= STREAM_GOAL})
    hg = b.get("hangs")
    if _ok(hg):
        worst = max((r["detected_s"]["max"] for r in hg["rows"] if r["detected_s"]["max"] is not None), default=None)
        faults = sum(r["faults"] for r in hg["rows"])
        found.append({"goal": f"every injected hang found within stall + {HANG_MARGIN:g} s",
                      "value": f"{sum(r['found'] for r in hg['rows'])} of {faults} found, slowest after "
                               f"{_num(worst, 2)} s (stall {hg['stall_s']:g} s)",
                      "met": worst is not None and all(r["found"] == r["faults"] for r in hg["rows"])
                      and worst <= hg["stall_s"] + HANG_MARGIN})
        found.append({"goal": "the injected rank named as the hang's culprit, every time",
                      "value": "; ".join(f"{r['kind']} {r['right']}/{r['faults']}" for r in hg["rows"]),
                      "met": all(r["right"] == r["faults"] for r in hg["rows"])})
    wc = b.get("watch_cost")
    if _ok(wc):
        pairs = wc["pair_images_per_s_ratios"]
        spread = max(pairs) - min(pairs)
        noisy = spread > 2 * (1 - WATCH_GOAL)  # the pairs disagree by more than the effect to resolve
        found.append({"goal": f"the health watch costs the payload at most {1 - WATCH_GOAL:.0%} of its img/s",
                      "value": f"on / off = {wc['images_per_s_ratio']:.4f} (pairs: "
                               f"{', '.join(f'{r:.3f}' for r in pairs)}); one sample every {wc['sample_every_s']:g} s "
                               f"costs a node {wc['sampling_cpu_share']:.3%} of a core",
                      "met": None if noisy else wc["images_per_s_ratio"] >= WATCH_GOAL,
                      "open": "open (this machine's noise)",
                      "note": f"the pairs' ratios span {spread:.0%} here, more than the {1 - WATCH_GOAL:.0%} to "
                              "resolve: others' load; the watch's own CPU bounds its cost" if noisy else None})
    rc = b.get("recovery")
    if _ok(rc):
        for row, goal in zip(rc["rows"], RECOVERY_GOALS, strict=False):
            found.append({"goal": f"{row['failure']}: kill to the next attempt's first step <= {goal:g} s (median)",
                          "value": f"{row['total_s']} s" + (f" (before issue 48: {row['before_total_s']} s)"
                                                            if "before_total_s" in row else ""),
                          "met": row["total_s"] <= goal})
        found.append({"goal": "no step redone after a lost rank or host (payload, DDP)",
                      "value": "; ".join(f"{row['steps_redone']}" for row in rc["rows"]),
                      "met": all(not any(row["steps_redone"]) for row in rc["rows"])})
    sc = b.get("scale")
    if _ok(sc):
        found += _scale_goals(sc)
    sl = b.get("slow")
    if _ok(sl):
        found += [_slow_goal(row, sl["back_share"]) for row in sl["rows"]]
    return found


def _slow_goal(row: dict[str, Any], share: float) -> dict[str, Any]:
    acting = row["acting"]
    back = acting["back_s"]
    return {"goal": f"{row['target']}: back to {share:.0%} of the healthy step rate within health.slow_for "
                    f"({row['slow_for_s']:g} s) + {row['goal_s'] - row['slow_for_s']:g} s of the slowness, 0 steps "
                    "redone",
            "value": (f"back after {back} s" if back is not None else "never back") + f"; steps redone "
                     f"{acting['steps_redone']}; {_num(acting['after_steps_per_s'], 1)} steps/s after, "
                     f"{row['after_vs_healthy']}x healthy",
            "met": row["met"]}


def _interval_goal(goal: str, found: dict[str, Any], limit: float, at_most: bool = True) -> dict[str, Any]:
    """A goal judged on a comparison's 95% interval (bench/stats.py): undecided while the interval holds the limit."""
    return {"goal": goal, "value": f"{stats.describe(found)}; {stats.stopped(found)}",
            "met": stats.judge(found["low"], found["high"], limit, at_most=at_most),
            "open": "undecided (the 95% interval holds the goal)"}


def _scale_goals(sc: dict[str, Any]) -> list[dict[str, Any]]:
    rows, last = sc["rows"], sc["rows"][-1]
    at = f"{last['nodes']} x {last['ranks'] // last['nodes']}"
    growth = last["cost_per_node_vs_smallest"]
    slowest = max(max(r["answer_s"].get("status", 0), r["answer_s"].get("top", 0)) for r in rows)
    goals = [
        {"goal": f"the controller's CPU per node at {last['nodes']} nodes within {SCALE_GROWTH:g}x of at "
                 f"{rows[0]['nodes']}", "value": f"{growth}x", "met": growth <= SCALE_GROWTH},
        {"goal": f"the controller at most {SCALE_CORES:g} core and {SCALE_GIB:g} GiB at {at} ranks",
         "value": f"{last['controller_cores']} cores, {last['controller_peak_rss_mib']:.0f} MiB at its peak",
         "met": last["controller_cores"] <= SCALE_CORES and last["controller_peak_rss_mib"] <= SCALE_GIB * 1024},
        _hang_goal(rows),
        {"goal": f"`harness status` and `top` answer within {ANSWER_S:g} s, at every size",
         "value": f"slowest median {slowest} s", "met": slowest <= ANSWER_S},
    ]
    if fleet := sc.get("stand_in_rows"):
        big = fleet[-1]
        at = f"{big['nodes']} x {big['ranks'] // big['nodes']}"
        answers = max(big["answer_s"].get("status", 0), big["answer_s"].get("top", 0))
        kept_up = big["record_lines_per_s"] >= KEPT_UP * big.get("printed_lines_per_s", 0)
        goals += [
            {"goal": f"stand-in nodes, {at}: the controller at most {SCALE_CORES:g} core and {FLEET_GIB:g} GiB, its "
                     f"record keeping up with the ranks' lines",
             "value": f"{big['controller_cores']} cores, {big['controller_peak_rss_mib']:.0f} MiB at its peak; "
                      f"{big['record_lines_per_s']:.0f} of {big.get('printed_lines_per_s', 0):.0f} lines a second "
                      f"recorded",
             "met": big["controller_cores"] <= SCALE_CORES and big["controller_peak_rss_mib"] <= FLEET_GIB * 1024
             and kept_up,
             "note": None if kept_up else "the controller is at one core, its GIL: the record falls behind the "
                                          "ranks' lines"},
            {**_hang_goal(fleet), "goal": f"stand-in nodes: {_hang_goal(fleet)['goal']}"},
            {"goal": "stand-in nodes: no rank named slow where none is, at every size",
             "value": "; ".join(f"{r['nodes']} nodes: {r.get('wrongly_slow', '-')}" for r in fleet),
             "met": all(r.get("wrongly_slow") == 0 for r in fleet)},
            {"goal": f"stand-in nodes, {at}: `harness status` and `top` answer within {ANSWER_S:g} s",
             "value": f"slowest median {answers} s", "met": answers <= ANSWER_S},
        ]
    return goals


def _hang_goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"goal": f"a hang found within stall + {HANG_MARGIN:g} s and its rank named, at every size",
            "value": "; ".join(f"{r['nodes']} nodes: found after {r.get('found_s', '-')} s, verdict after "
                               f"{r['verdict_s']} s, {'named' if r['culprit_named'] else 'NOT named'}" for r in rows),
            "met": all(r["verdict_s"] <= r["verdict_goal_s"] and r["culprit_named"] for r in rows),
            "note": "the verdict waits for every rank's stack: more ranks than two cores read within 15 s"
                    if any(r["verdict_s"] > r["verdict_goal_s"] for r in rows) else None}


def _floor_ratio(row: dict[str, Any], mode: str, cores: int) -> float:
    """Wall time / (CPU seconds the whole machine spent / cores): 1.0 = as parallel as the CPU allows."""
    floor = row[f"{mode}_machine_cpu_s"] / cores
    return round(row[f"{mode}_s"] / floor, 2) if floor else float("nan")


def _mark(goal: dict[str, Any]) -> str:
    mark = {True: "met", False: "**missed**", None: goal.get("open", "open (needs a GPU)")}[goal["met"]]
    return f"{mark}: {goal['note']}" if goal.get("note") else mark


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return [*lines, ""]


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _machine(result: dict[str, Any]) -> list[str]:
    m = result["machine"]
    v = m["versions"]
    commit = (m["git"]["commit"] or "unknown")[:12] + (" (uncommitted changes)" if m["git"]["dirty"] else "")
    return _table(["", ""], [
        ["date (UTC)", m["date"]],
        ["host", m["host"]],
        ["CPU", f"{m['cpu']}, {m['cores']} cores"],
        ["memory", f"{m['memory_gib']} GiB"],
        ["GPU", ", ".join(m["gpus"]) or "none"],
        ["load average at start", " / ".join(str(x) for x in m["load_average_at_start"])],
        ["versions", f"python {v['python']}, torch {v['torch']}, torchvision {v['torchvision']}, "
                     f"harness {v['harness']}"],
        *([["GPU stack", f"driver {v['driver']}, CUDA {v['cuda']}, cuDNN {v['cudnn']}, NCCL {v['nccl']}"]]
          if v.get("driver") else []),
        ["commit", commit],
        ["run time", f"{result['duration_s']} s"],
    ])


def _failed(bench: dict[str, Any]) -> list[str] | None:
    if "error" in bench:
        return [f"failed: `{bench['error'].splitlines()[0]}` (the result file has the rest)", ""]
    if "skipped" in bench:
        return [f"skipped: {bench['skipped']}", ""]
    return None


def _throughput(tp: dict[str, Any]) -> list[str]:
    peak = tp["peak"]
    lines = [f"{tp['model']} on {tp['device']}, batch {tp['batch_size']}, {tp['flops_per_image'] / 1e9:.3g} GFLOP "
             f"per image (forward + backward, FlopCounterMode); {tp['steps_timed']} steps timed after "
             f"{tp['warmup_steps']} warm-up, best of {tp['repeats']}. MFU against "
             f"{_num(peak['flops'] / 1e9 if peak['flops'] else None)} GFLOP/s: {peak['source']}"
             + ("".join(f"; {k} {v / 1e9:,.0f}" for k, v in peak.get("measured", {}).items()) + " GFLOP/s measured"
                if peak.get("measured") else "") + ".", ""]
    lines += _table(
        ["path", "precision", "compile", "channels_last", "input", "img/s", "vs seed", "GFLOP/s", "MFU"],
        [[r["name"], r["precision"], r["compile"], r["channels_last"], r["input"], _num(r["images_per_s"]),
          "-" if r.get("no_model") else f"{r['vs_seed']}x", _num(r.get("achieved_gflop_s"), 1),
          _percent(r.get("mfu"))] for r in tp["rows"]])
    if not tp["time_to_accuracy"]:  # the quick run leaves it to the full one
        return lines
    lines += ["Time to accuracy, digits job (small model, global batch 64, from process start):", ""]
    lines += _table(
        ["ranks", "test acc >= target", "epoch", "s from start", "s of training", "final acc", "process s"],
        [[a["ranks"], a["target"], a["epoch"], a["seconds_from_start"], a["training_seconds"], a["final_test_acc"],
          a["process_seconds"]] if "skipped" not in a else [a["ranks"], a["skipped"], "", "", "", "", ""]
         for a in tp["time_to_accuracy"]])
    return lines


def _tuning(t: dict[str, Any]) -> list[str]:
    peak = t["peak"]
    lines = [f"{t['model']} on {t['device']}, {t['precision']}, the payload's fast path (device-resident data, "
             f"batched augmentation, channels_last) at each per-rank batch and torch.compile mode; "
             f"{t['steps_timed']} steps timed after {t['warmup_steps']} warm-up. MFU against "
             f"{_num(peak['flops'] / 1e12 if peak['flops'] else None)} TFLOP/s ({peak['source']}). Run s: the "
             "whole run, compilation included. Frames: what dynamo compiled (1: no recompiles).", ""]
    return lines + _table(
        ["batch", "compile", "img/s", "MFU", "peak GPU memory GiB", "run s", "frames"],
        [[r["batch_size"], r["compile"], f"failed: `{r['error']}`", "", "", "", ""] if "error" in r else
         [r["batch_size"], r["compile"], _num(r["images_per_s"]), _percent(r["mfu"]),
          r["peak_memory_gib"], r["run_s"], "-" if r["compiled_frames"] is None else r["compiled_frames"]]
         for r in t["rows"]])


def _ddp(d: dict[str, Any]) -> list[str]:
    threads = f", {d['threads_per_rank']} thread per rank" if d["threads_per_rank"] else ""
    lines = [f"The payload, {d['model']}, batch {d['batch_size_per_rank']} per rank, {d['precision']}, "
             f"{d['backend']} on {d['device']}{threads}; {d['steps_timed']} steps timed, best of {d['repeats']}.", ""]
    return lines + _table(
        ["run", "ranks", "img/s (all ranks)", "img/s per rank", "efficiency"],
        [[r["name"], r["ranks"], _num(r.get("images_per_s")), _num(r.get("per_rank")),
          f"{r['efficiency']:.0%}" if r.get("efficiency") else r.get("skipped", "-")] for r in d["rows"]])


def _strategies(s: dict[str, Any]) -> list[str]:
    cpu = s["device"] == "cpu"
    threads = f", {s['threads_per_rank']} thread per rank" if s["threads_per_rank"] else ""
    memory = "resident set (interpreter, torch and data included)" if cpu else "CUDA tensors (max_memory_allocated)"
    gloo = "; on CPU with gloo the communication dominates a small model" if cpu else ""
    lines = [f"The payload with `--strategy ddp` and `--strategy fsdp` (FSDP2: each residual block, then the root), "
             f"{s['model']}, batch {s['batch_size_per_rank']} per rank, the same global batch and synthetic data for "
             f"both, {s['precision']}, {s['backend']} on {s['device']}{threads}; {s['steps_timed']} steps timed, best "
             f"of {s['repeats']}. Peak memory: the fullest rank's {memory}, the most of any attempt. Training state: "
             "the fullest rank's parameters, gradients and optimizer state. FSDP shards the training state, so its "
             f"share per rank falls as ranks grow while it pays all-gathers per block{gloo}.", ""]

    def ratio(row: dict[str, Any], key: str) -> str:
        return f"{row[key + '_vs_ddp']:.2f}x" if key + "_vs_ddp" in row else "-"

    return lines + _table(
        ["strategy", "ranks", "global batch", "img/s (all ranks)", "peak memory MiB", "training state MiB",
         "img/s vs DDP", "peak vs DDP", "state vs DDP"],
        [[r["strategy"], r["ranks"], r["global_batch"], r["skipped"], "", "", "", "", ""] if "skipped" in r else
         [r["strategy"], r["ranks"], r["global_batch"], _num(r["images_per_s"]), _num(r["peak_memory_mib"]),
          _num(r["state_mib"], 2), ratio(r, "images_per_s"), ratio(r, "peak_memory_mib"), ratio(r, "state_mib")]
         for r in s["rows"]])


def _rounds(found: dict[str, Any] | None, what: str) -> list[str]:
    """A comparison's line: its mean, 95% interval and rounds, and why the rounds stopped."""
    if found is None:  # results recorded before the rounds
        return []
    return [f"{what}: {stats.describe(found)}; {stats.stopped(found)}.", ""]


def _first_step(f: dict[str, Any]) -> list[str]:
    rounds = "difference" in f
    others = f", the others in the first {f['repeats']} of them" if len(f["rows"]) > 2 else ""
    statistic = (f"medians; harness launch and torchrun by hand in interleaved rounds{others}" if rounds
                 else f"median of {f['repeats']}")
    ending = " Ending: from rank 0's last line to the end of every process of the job." if "ending_s" in f["rows"][0] \
        else ""
    lines = [f"{f['job']}; from starting the command to rank 0's first progress line; {statistic}. `harness render` "
             f"of the same job (CLI start + plan): {f['harness_render_s']} s.{ending}", ""]
    lines += _table(
        ["launcher", "first step s", "vs torchrun by hand", "job end s", "ending s", "attempts"],
        [[r["name"], r["first_step_s"], f"{r['vs_torchrun_by_hand_s']:+.2f} s", r["job_end_s"], r.get("ending_s", "-"),
          ", ".join(str(a) for a in r["attempts_first_step_s"])] for r in f["rows"]])
    lines += _rounds(f.get("difference"), "harness launch - torchrun by hand, mean of the rounds' paired differences")
    if "trivial_job" not in f:  # results recorded before the trivial job's rows, and quick runs
        return lines
    trivial = _table(["launcher", "end to end s", "vs torchrun by hand", "ratio", "attempts"],
                     [[r["name"], r["end_to_end_s"], f"{r['vs_torchrun_by_hand_s']:+.2f} s", f"{r['ratio']:.2f}x",
                       ", ".join(str(a) for a in r["attempts_s"])] for r in f["trivial_job"]])
    return [*lines, "bench/noop.py (join, one all_reduce, leave), end to end, the launchers alternating (medians):",
            "", *trivial, *_rounds(f.get("trivial_difference"), "harness launch - torchrun by hand, paired")]


def _harness_cost(h: dict[str, Any]) -> list[str]:
    lines = [f"{h['job']}. The launchers alternate in rounds (the order swapped each round); img/s: the mean of the "
             "rounds with its 95% interval.", ""]
    lines += _table(["launcher", "img/s (mean)", "95% interval", "attempts"],
                    [[r["name"], _num(r["images_per_s"]), f"{_num(r['low'])} - {_num(r['high'])}",
                      ", ".join(_num(a) for a in r["attempts_images_per_s"])] for r in h["rows"]])
    return lines + _rounds(h["ratio"], "img/s harness launch / torchrun, mean of the rounds' ratios")


def _preflight(p: dict[str, Any]) -> list[str]:
    cores = p["cores"]
    lines = [f"Real sshd hosts in network namespaces (cluster built in {p['cluster_build_s']} s), all sharing this "
             f"machine's {cores} cores; median of {p['repeats']}. `preflight`: `harness preflight HOSTS --job JOB` "
             "as typed (it imports torch on every host); `fast checks`: what `harness launch --hosts` runs before "
             "starting (no torch import). Vs linear: t(k) / (k x t(1)), 1.0 for a tool that visits hosts one by "
             "one. CPU floor: CPU seconds the whole machine spent during the run / cores, the least wall time the "
             "shared cores allow (it counts anything else running, too). Controller CPU: the harness process."
             + (f" Today's: the same command from commit {p['baseline']}, before the interface checks, run "
                "alternately with it on the same hosts (each host: management eth0, data eth1, extra0 routing "
                f"nowhere, hostname -> 127.0.1.1, on which today's preflight fails "
                f"`{', '.join(p['baseline_fails'])}`)." if "baseline" in p else ""), ""]
    baseline = "baseline" in p
    modes = p.get("modes", ["full", "fast"])  # results from before the quick run's choice have both
    lines += _table(
        ["hosts", *(h for mode in modes for h in ({"full": "preflight s", "fast": "fast checks s"}[mode],
                                                    *(("today's s", "ratio") if baseline else ()), "vs linear",
                                                    "CPU floor s", "controller CPU s"))],
        [[r["hosts"]] + [v for mode in modes for v in (
            r[f"{mode}_s"], *((r[f"baseline_{mode}_s"], r[f"{mode}_vs_baseline"]) if baseline else ()),
            r[f"{mode}_vs_linear"], round(r[f"{mode}_machine_cpu_s"] / cores, 2),
            r[f"{mode}_controller_cpu_s"])] for r in p["rows"]])
    return lines + [f"Note: {n}" for n in p.get("notes", [])] + ([""] if p.get("notes") else [])


def _failure(f: dict[str, Any]) -> list[str]:
    lines = [f"{f['script']}; survivors either sleep (`sleep`: nothing but a supervisor ends them) or wait in an "
             f"all-reduce (`collective`: gloo notices the closed connection by itself; NCCL would wait for its "
             f"timeout). Seconds after the death; harness rows: median of {f.get('repeats', 1)}.", ""]
    rows = []
    for r in f["rows"]:
        if r["launcher"] == "harness launch":
            attempts = ", ".join(_num(a, 2) for a in r.get("attempts_all_gone_s", []))
            rows.append([r["launcher"], r["block"], r["detected_s"], f"{_num(r['all_gone_s'], 2)} ({attempts})",
                         r["launcher_exit_s"], r["alive_at_end"]])
        else:
            gone = _num(r["all_gone_s"], 2) if r["all_gone_s"] is not None else f"not within {r['bounded_wait_s']} s"
            rows.append([r["launcher"], r["block"], "-", gone, "-",
                         f"{r['alive_at_end']} after {r['bounded_wait_s']} s (then killed)"])
    return lines + _table(["launcher", "survivors", "failure seen", "all processes gone (attempts)",
                           "launcher exit", "processes still alive"], rows)


def _recovery(r: dict[str, Any]) -> list[str]:
    before = all("before_total_s" in row for row in r["rows"])  # results from before the side-by-side runs have none
    lines = [f"{r['job']}; the node is killed when rank 0 reports step {r['kill_at_step']}. Seconds from the kill, "
             f"median of {r['repeats']}; phases as in bench/recovery.py. Steps redone: the last step the failed "
             f"attempt logged minus the step the next one resumed from (a checkpoint every `ckpt_every` steps)."
             + (f" In parentheses: the same failure with the harness before issue 48 ({r['before']}), alternating "
                "with today's in the same run." if before else ""), ""]

    def then(row: dict[str, Any], key: str) -> str:
        return f"{_num(row[key], 2)} ({_num(row['before_' + key], 2)})" if before else _num(row[key], 2)

    rows = [[row["failure"], " -> ".join(map(str, row.get("world_sizes", []))) or "-",
             f"{then(row, 'total_s')}; attempts {', '.join(_num(a, 2) for a in row['attempts_total_s'])}"
             + (f"; {row['total_vs_before']:.2f}x" if before else ""),
             *(then(row, f"{phase}_s") for phase in ("detection", "teardown", "preflight", "start-up", "load",
                                                     "first step")),
             f"{row['steps_redone']} of {row['ckpt_every']}" + (f" ({row['before_steps_redone']})" if before else ""),
             ", ".join(row.get("warm") or []) or "-"] for row in r["rows"]]
    lines += _table(["failure", "world size", "kill to next first step", "detection", "teardown",
                     "preflight", "start-up", "checkpoint load", "first step", "steps redone", "started warm"], rows)
    if all("goodput" in row for row in r["rows"]):  # results from before the runs' time was bucketed have none
        buckets = [key for key in r["rows"][0] if key.startswith("time_")]
        lines += ["", "Where each run's time went (summary.json's goodput; seconds, median):", ""]
        lines += _table(["failure", "goodput", *(key.removeprefix("time_").removesuffix("_s") for key in buckets)],
                        [[row["failure"], _percent(row["goodput"]), *(_num(row[key], 1) for key in buckets)]
                         for row in r["rows"]])
    if all("recorded_total_s" in row for row in r["rows"]):  # results from before restarts were recorded have none
        phases = [key for key in r["rows"][0] if key.startswith("recorded_") and key != "recorded_total_s"]
        lines += ["", "The same restarts as their records tell them (summary.json's attempts[1].restart, from the "
                      "failed attempt's last progress line to the first step; seconds, median):", ""]
        lines += _table(["failure", "total", *(key.removeprefix("recorded_").removesuffix("_s") for key in phases)],
                        [[row["failure"], _num(row["recorded_total_s"], 2), *(_num(row[key], 2) for key in phases)]
                         for row in r["rows"]])
    return lines + [f"Note: {n}" for n in r.get("notes", [])] + ([""] if r.get("notes") else [])


def _attach(a: dict[str, Any]) -> list[str]:
    rows = {row["case"]: row for row in a["rows"]}
    att, rel = rows["attach"], rows["relaunch"]
    lines = [f"{a['job']}. The controller (`harness launch`) is SIGKILLed when rank 0 reports step "
             f"{a['kill_at_step']} (its standbys waiting); the two answers alternate in one run, {a['repeats']} of "
             "each; seconds from the kill, median (each repeat in parentheses). Watched again: `harness attach`'s "
             "`taken back by` line (every node's spool replayed), or the relaunched run's first step. Steps redone: "
             "attach, the step lines its record holds twice; relaunch, the last step the lost run recorded minus the "
             f"global step the new run resumed from. Steps of the job in all: {att['total_steps']}; a checkpoint "
             f"every {att['ckpt_every']}.", ""]

    def each(values: list[Any]) -> str:
        return ", ".join(str(v) for v in values)

    ssh = {row["case"]: row for row in a.get("ssh_rows", [])}
    lines += _table(
        ["answer", "nodes", "watched again", "next step line shown", "job's end", "step at the kill", "steps redone",
         "steps missing from the record", "run (attempts)", "processes left"],
        [[row["failure"], where, f"{_num(row['watched_again_s'], 2)} ({each(row['attempts_watched_again_s'])})",
          _num(row["first_step_s"], 2), _num(row["end_s"], 2), each(row["kill_steps"]), each(row["steps_redone"]),
          each(row["steps_missing"]), f"{each(row['statuses'])} ({each(row['attempts'])})", each(row["left"])]
         for where, row in [("simulated", att), ("simulated", rel), *(("SSH", ssh[c]) for c in ssh)]])
    if cut := a.get("cut"):
        made = [_num(v, 2) if v is not None else "none" for v in cut["attempts_made_again_s"]]
        lines += [f"A link cut on SSH ({cut['failure']}; {len(cut['restarts'])} repeats): restarts "
                  f"{each(cut['restarts'])}; the `made again` line, seconds from the cut's end: {each(made)} (none: "
                  f"TCP carried the link over the cut before the keepalive, timeouts.connect, gave it up); steps "
                  f"redone {each(cut['steps_redone'])}, missing {each(cut['steps_missing'])}; "
                  f"{each(cut['statuses'])}; processes left {each(cut['left'])}.", ""]
    whole = att["in_order"] and not any(att["steps_redone"]) and not any(att["steps_missing"])
    lines += [f"Attach: the new controller's first line {_num(att['new_controller_first_line_s'], 2)} s after the "
              f"kill; the record's time unwatched (attached_at - lost_at) {_num(att['recorded_unwatched_s'], 2)} s "
              f"(the attach said {_num(att['said_lost_s'], 1)} s); steps trained unwatched (rank 0's step lines "
              f"stamped between lost_at and attached_at): {each(att['steps_unwatched'])}; lines the nodes said "
              f"meanwhile: {each(att['lines_meanwhile'])}; every step line once and in order: "
              f"{'yes' if whole else '**no**'}.", "",
              f"Relaunch: every process of the lost run gone {_num(rel['nodes_gone_s'], 2)} s after the kill; the "
              f"lost run recorded up to step {each(rel['reached'])}, the new run resumed from {each(rel['resumed'])} "
              "(steps the ranks trained after the kill, recorded nowhere, kept by their SIGTERM's just-in-time "
              f"checkpoint: {each(rel['steps_unrecorded'])}).", ""]
    buckets = [key for key in att if key.startswith("time_")]
    lines += ["Where each run's time went (summary.json's goodput; the relaunch's: the new run's alone; seconds, "
              "median):", ""]
    return lines + _table(["answer", "goodput", *(key.removeprefix("time_").removesuffix("_s") for key in buckets)],
                          [[row["case"], _percent(row["goodput"]), *(_num(row.get(key), 1) for key in buckets)]
                           for row in (att, rel)])

def _slurm(s: dict[str, Any]) -> list[str]:
    lines = [f"{s['cluster']}; median of {s['repeats']}. Submit to first step: {s['first_step_job']}.", ""]
    lines += _table(["command", "submit to rank 0's first step, s (attempts)"],
                    [[r["name"], f"{_num(r['first_step_s'], 2)} ({', '.join(_num(a, 2) for a in r['attempts_s'])})"]
                     for r in s["first_step"]])
    lines += [f"Rank death to job end: {s['failure_job']}.", ""]
    rows = [[r["name"], _num(r["job_end_s"], 2) if r["job_end_s"] is not None else
             f"still running after {r.get('bounded_wait_s')} s (cancelled)", _num(r["launcher_exit_s"], 2)
             if r["launcher_exit_s"] is not None else "-"] for r in s["failure"]]
    return lines + _table(["command", "death to the job's end in Slurm, s", "death to the harness's exit, s"], rows)


def _containers(c: dict[str, Any]) -> list[str]:
    lines = [f"{c['cluster']}; {c['job']}; median of {c['repeats']}. From the command's start to rank 0's first "
             f"step, the fast preflight included.", ""]
    lines += _table(["node runs", "launch to first step, s (attempts)"],
                    [[r["name"], f"{_num(r['first_step_s'], 2)} ({', '.join(_num(a, 2) for a in r['attempts_s'])})"]
                     for r in c["rows"]])
    summary = (f"The container costs {_num(c['container_extra_s'], 2)} s more ({_num(c['ratio'], 2)}x); "
               f"`podman run --rm IMAGE true` alone takes {_num(c['podman_run_true_s'], 2)} s on a host.")
    return [*lines, summary, ""]


def _hangs(h: dict[str, Any]) -> list[str]:
    lines = [f"{h['script']}; `health: {{stall: {h['stall_s']:g}}}`; {h['faults_per_kind']} faults of each kind, "
             f"each in a launch of its own, on rank 0 or 1 drawn at random (seed {h['seed']}), at a random step in "
             f"{h['fault_steps'][0]}..{h['fault_steps'][1]}, kinds interleaved. Detected: from the fault to the "
             "`harness: hang: ...` line (median / max); beyond stall: the same less the stall. Right: summary.json's "
             "first failure (kind `hang`) names the injected rank. Stacks: launches that kept rank0.txt and "
             "rank1.txt. Left: processes of the run alive after the launch exited (most of any launch).", ""]
    lines += _table(
        ["fault", "faults (rank 0 / 1)", "found", "right rank", "detected s", "beyond stall s", "launch exit s",
         "named rank 0 / 1 / none", "stacks kept", "left"],
        [[r["fault"], f"{r['faults']} ({r['per_rank']['0']} / {r['per_rank']['1']})", r["found"],
          f"{r['right']} ({_percent(r['accuracy'])})",
          f"{_num(r['detected_s']['median'], 2)} / {_num(r['detected_s']['max'], 2)}",
          f"{_num(r['beyond_stall_s']['median'], 2)} / {_num(r['beyond_stall_s']['max'], 2)}",
          f"{_num(r['exit_s']['median'], 2)} / {_num(r['exit_s']['max'], 2)}",
          f"{r['named']['0']} / {r['named']['1']} / {r['named']['None']}", r["all_stacks_kept"], r["left"]]
         for r in h["rows"]])
    lines += ["Verdicts (the last of each kind):", ""]
    for r in h["rows"]:
        last = [a for a in h.get("attempts", {}).get(r["kind"], []) if a.get("verdict")]
        example = last[-1]["verdict"] if last else r["example_verdict"]
        lines += [f"- {r['kind']}: `hang: {example}`"] if example else []
    lines += [""]
    if h["torchrun"]:
        t0 = h["torchrun"][0]
        lines += [f"torchrun alone (2 agents by hand, the same script) never calls a job hung: a rank's collective "
                  f"fails when init_process_group's timeout runs out, by default {h['torchrun_defaults_s']['gloo']} s "
                  f"for gloo and {h['torchrun_defaults_s']['nccl']} s for NCCL. Here the timeout was set to "
                  f"{t0['pg_timeout_s']:g} s; seconds from the fault to the first error line; ranks named: every "
                  f"rank number its output mentions after the fault; left: processes alive "
                  f"{t0['left_after_s']:g} s after the fault (then killed).", ""]
        lines += _table(["fault", "error shown s", "injected rank", "ranks named", "culprit named",
                         "first agent exit s", "left"],
                        [[KIND_NAMES.get(r["kind"], r["kind"]), _num(r["error_shown_s"]["median"], 2),
                          ", ".join(map(str, r["injected"])), "; ".join(str(n) for n in r["ranks_named"]),
                          f"{r['culprit_named']} of {r['runs']}",
                          ", ".join(_num(x, 2) for x in r["first_agent_exit_s"]), ", ".join(map(str, r["left"]))]
                         for r in h["torchrun"]])
    for row in h["rows"]:  # the misses of each kind: how many, how, and the first of them
        misses = [m for m in h.get("misses", []) if m["kind"] == row["kind"]]
        if misses:
            first = misses[0]
            found = [m.get("named_rank") for m in misses if m["found"]]
            named = ", ".join(f"{'none' if n is None else f'rank {n}'} x {found.count(n)}"
                              for n in sorted(set(found), key=str))
            lines += [f"Missed or misnamed, {row['fault']}: {len(misses)} of {row['faults']} (not found: "
                      f"{sum(not m['found'] for m in misses)}; rank named instead: {named or '-'}). The first, rank "
                      f"{first['injected_rank']} faulted (run {first['run_id']}): "
                      + (f"`hang: {first.get('verdict')}`" if first["found"] else f"not found: {first.get('error')}"),
                      ""]
    lines += [f"Note: {n}" for n in h.get("notes", [])] + ([""] if h.get("notes") else [])
    start, end = h.get("harness_tree_at_start"), h.get("harness_tree")
    if start is not None and start != end:
        lines += [f"**The harness changed during this run** (each launch ran the tree of its time): at the start "
                  f"{', '.join(start)}; at the end {', '.join(end or [])}. The result file's attempts give each "
                  "launch's run id (its time) and verdict.", ""]
    elif end and len(end) > 1:
        lines += [f"The harness tree measured had uncommitted changes in: {', '.join(end[1:])}.", ""]
    return lines


KIND_NAMES = {"stop": "rank SIGSTOPped", "sleep": "rank stuck in time.sleep in its step",
              "skip": "rank skips an all_reduce and ends its loop"}


def _watch_cost(w: dict[str, Any]) -> list[str]:
    arms = "on, on without Flight Recorder and off, interleaved" if "flight_recorder_read" in w else \
        "on and off alternately"
    lines = [f"{w['job']}; `harness launch`, the health watch {arms}, {w['repeats']} of each. "
             "First step: from the command's start to rank 0's first progress line. Ratios: on / off, median "
             "of the pairs.", ""]
    lines += _table(["health watch", "spec", "img/s (median)", "attempts", "first step s (median)", "attempts"],
                    [[r["arm"], f"`{r['health']}`" + "".join(f", `{k}={v}`" for k, v in r.get("env", {}).items()),
                      _num(r["images_per_s"]),
                      ", ".join(_num(a) for a in r["attempts_images_per_s"]), r["first_step_s"],
                      ", ".join(str(a) for a in r["attempts_first_step_s"])] for r in w["rows"]])
    if "flight_recorder_read" in w:
        fr = w["flight_recorder_read"]
        lines.append(f"One read of a rank's Flight Recorder ({fr['entries']} entries), as the agent makes it with each "
                     f"sample: {fr['rank_cpu_ms']} ms of the rank's CPU (torch's worker server) and "
                     f"{fr['agent_cpu_ms']} ms of the agent's; every {w['sample_every_s']:g} s: "
                     f"{100 * fr['rank_cpu_share']:.3f}% of one core per rank.")
        lines.append("")
    if "flight_recorder_images_per_s_ratio" in w:
        lines.append(f"img/s with Flight Recorder / without it (health on in both): "
                     f"{w['flight_recorder_images_per_s_ratio']:.4f} (rounds: "
                     f"{', '.join(f'{r:.3f}' for r in w['pair_flight_recorder_ratios'])})")
        lines.append("")
    return [*lines, f"img/s on / off: {w['images_per_s_ratio']:.4f} (pairs: "
            f"{', '.join(f'{r:.3f}' for r in w['pair_images_per_s_ratios'])}); time to first step on / off: "
            f"{w['first_step_ratio']:.3f} (pairs: {', '.join(f'{r:.3f}' for r in w['pair_first_step_ratios'])}).", "",
            f"What the watch itself spends, without the noise of a shared machine: one sample of a node's ranks "
            f"(process tree, ranks, their /proc figures; measured over both nodes' trees while the payload ran) "
            f"takes {w['sample_cpu_ms']:.2f} ms of CPU, every {w['sample_every_s']:g} s by default: "
            f"{w['sampling_cpu_share']:.3%} of one core per node.", ""]


def _metrics_cost(m: dict[str, Any]) -> list[str]:
    lines = [f"{m['job']}. The controller's own CPU (its watch, the stream, the record) over {m['window_s']} s without "
             f"scrapes: {m['controller_cpu_share']:.2%} of one core, {m['controller_cpu_share_per_rank']:.2%} per "
             f"rank. "
             f"One scrape ({m['scrape_bytes']} bytes; {m['scrapes']} back to back, less that rate): "
             f"{m['scrape_cpu_ms']} ms of the controller's CPU; every {m['scrape_every_s']:g} s: "
             f"{m['scrape_cpu_share_per_rank']:.4%} of one core per rank.", "",
             "One scrape of a larger run's record, timed in process (RunMetrics and prometheus-client's text):", ""]
    every = f"share of a core per rank, every {m['scrape_every_s']:g} s"
    return lines + _table(["ranks", "CPU ms per scrape", "bytes", every],
                          [[r["ranks"], r["cpu_ms"], r["bytes"], f"{r['cpu_share_per_rank']:.4%}"]
                           for r in m["synthetic"]]) + [""]


def _stream(s: dict[str, Any]) -> list[str]:
    return [f"{s['job']}; median of {s['repeats']}, alternating. Harness / torchrun: {s['ratio']:.3f}.", "",
            *_table(["launcher", "end to end (s)", "attempts (s)"],
                    [[r["name"], r["seconds"], ", ".join(str(a) for a in r["attempts_s"])] for r in s["rows"]]),
            *_rounds(s.get("paired_ratio"), "harness / torchrun, mean of the rounds' ratios"), ""]


def _k8s(k: dict[str, Any]) -> list[str]:
    lines = [f"{k['job']}. The rendered pods run as processes here, exactly as their containers say (bench/k8s.py); "
             f"seconds, median of {k['repeats']}. Bare: the failure as a JobSet's Recreate restarts it, played at "
             "once (no API calls, scheduling or container start counted: its floor).", ""]

    def cell(row: dict[str, Any], way: str) -> str:
        return f"{_num(row[f'{way}_s'], 2)} ({', '.join(_num(a, 2) for a in row[f'{way}_attempts_s'])})"

    return lines + _table(["", "supervised", "bare torchrun pods", "supervised / bare"],
                          [[r["what"], cell(r, "supervised"), cell(r, "bare"), f"{r['ratio']:.2f}x"]
                           for r in k["rows"]]) + [""]


def _scale(s: dict[str, Any]) -> list[str]:
    lines = [f"{s['job']}; {s['cores']} cores. CPU per node per second: the controller's CPU seconds over the window, "
             "divided by nodes and seconds; answers: the whole command as typed, median.", ""]
    lines += _scale_rows(s["rows"], "agent CPU per s, MiB")
    if s.get("stand_in_rows"):
        lines += ["Stand-in nodes (testbed/fleet.py: one process serves every node's side of the agent protocol, so "
                  "that on two cores what grows is the controller's work alone); the fleet's own CPU per node in the "
                  "agent column. Record: the run folder's size at its end, per rank per second of the run.", ""]
        lines += _scale_rows(s["stand_in_rows"], "stand-ins' CPU per s, MiB")
    return lines + _scale_arrivals(s.get("arrivals", [])) + _scale_hang_look(s.get("hang_look")) + \
        _scale_ssh(s.get("ssh", {}))


def _scale_hang_look(row: dict[str, Any] | None) -> list[str]:
    if not row:
        return []
    return [f"The controller's CPU on its ranks' health alone (bench/scale.hang_look_cost), {row['nodes']} x "
            f"{row['ranks'] // row['nodes']} over {row['seconds']:g} s, a sample every {row['interval_s']:g} s, "
            f"the last rank stopping: the health messages taken {row['messages_cores']} cores; the look for a "
            f"hang at every tick {row['suspects_cores']} cores over the ranks that may be hung (each agent "
            f"judging its ranks' progress) against {row['every_rank_cores']} over every rank; both found the "
            f"rank {row['suspects_found_after_stop_s']} / {row['every_rank_found_after_stop_s']} s after it "
            f"stopped (stall {row['stall_s']:g} s).", ""]


def _scale_arrivals(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    return ["The controller's CPU on the ranks' arrivals alone (bench/scale.arrivals_cost), side by side: each node's "
            "collectives as its agent says them (one time for the ranks together, the stragglers by rank) against "
            "every rank's own arrivals (as an agent of an older harness says them); rank 0 late by a tenth of the "
            "time between collectives.", "",
            *_table(["nodes x ranks", "collectives per s per rank", "messages per s",
                     "controller cores: by node / by rank (ratio)", "rank 0's wait (%): by node / by rank",
                     "others' largest wait (%): by node / by rank"],
                    [[f"{r['nodes']} x {r['ranks'] // r['nodes']}", f"{r['collectives_per_s']:g}",
                      r["digest"]["messages_per_s"],
                      f"{r['digest']['cores']} / {r['every rank']['cores']} "
                      f"({r['every rank']['cores'] / max(r['digest']['cores'], 1e-9):.1f}x)",
                      f"{r['digest']['rank0_waited_pct']} / {r['every rank']['rank0_waited_pct']}",
                      f"{r['digest']['others_waited_max_pct']} / {r['every rank']['others_waited_max_pct']}"]
                     for r in rows]), ""]


def _scale_rows(rows: list[dict[str, Any]], agents: str) -> list[str]:
    return [*_table(
        ["nodes x ranks", "launch to all running (s)", "controller CPU per node per s (vs fewest)", "controller cores",
         "controller MiB (peak)", "threads, fds", agents,
         "ranks' lines recorded per s (lines written; terminal; s behind)",
         "record MiB (B/rank/s; of them the timeline's)",
         "status / top / logs --rank (s)", "hang to found + stacks read = verdict (s, goal)", "culprit named"],
        [[f"{r['nodes']} x {r['ranks'] // r['nodes']}", r["launch_to_running_s"],
          f"{r['controller_cpu_per_node_per_s']:.4f} ({r['cost_per_node_vs_smallest']}x)", r["controller_cores"],
          f"{r['controller_rss_mib']:.0f} ({r['controller_peak_rss_mib']:.0f})",
          f"{r['controller_threads']}, {r['controller_fds']}",
          f"{r['agent_cpu_per_s']:.4f}, {r['agent_rss_mib']:.0f}",
          f"{r['record_lines_per_s']:.0f} ({_num(r.get('record_written_lines_per_s'), 0)}; "
          f"{r['terminal_lines_per_s']:.0f}; {r.get('record_behind_s', '-')})",
          f"{r['record_mib']} ({r['record_bytes_per_rank_per_s']}"
          f"{'; ' + str(r['timeline_bytes_per_rank_per_s']) if 'timeline_bytes_per_rank_per_s' in r else ''})"
          if "record_mib" in r else "-",
          " / ".join(_num(r["answer_s"].get(k), 2) for k in ("status", "top", "logs_rank")),
          f"{r.get('found_s', '-')} + {r.get('capture_s', '-')} = {r['verdict_s']} ({r['verdict_goal_s']:g})"
          + (f"; stopped {r['stopped_s']} s later" if "stopped_s" in r else ""),
          ("yes" if r["culprit_named"] else "no") + (f"; {r['wrongly_slow']} ranks named slow, wrongly"
                                                      if r.get("wrongly_slow") else "")]
         for r in rows]), ""]


def _scale_ssh(ssh: dict[str, Any]) -> list[str]:
    if "skipped" in ssh or "error" in ssh or not ssh:
        why = ssh.get("skipped") or ssh.get("error") or "not in this result"
        return [f"Over SSH: not measured ({why[:500]}).", ""]
    return [f"Over SSH: {ssh['hosts']} sshd hosts in network namespaces (built in {ssh['cluster_build_s']} s), "
            f"{ssh['ranks'] // ssh['hosts']} stand-in ranks each: the fast checks before a launch "
            f"{ssh['fast_checks_s']} s; launch to every rank running {ssh['launch_to_running_s']} s, to the end "
            f"{ssh['launch_to_end_s']} s; the controller with {ssh['controller_threads']} threads and "
            f"{ssh['controller_sockets']} sockets, {ssh['controller_cores']} cores "
            f"({ssh['controller_cpu_per_node_per_s']:.4f} per node per second), "
            f"{ssh['controller_peak_rss_mib']:.0f} MiB at its peak. (`harness preflight` itself imports torch on "
            "every host at once, about 0.55 GiB each: benchmark 4 measures it up to 16 hosts.)", ""]


def _slow(s: dict[str, Any]) -> list[str]:
    lines = [f"{s['job']}. Node1's ranks put in a CPU cgroup of {s['share']:g} of one CPU (testbed/throttle.py) "
             f"{s['healthy_s']:g} s after the job's standbys wait, and kept there to their end; `restarts.on` with "
             "`slow` (acts) against without it (left slow to its end), one after the other. Step rates (steps/s) from "
             f"rank 0's step lines: healthy over the {s['healthy_s']:g} s before the throttle, slowed from it to the "
             "action (or the job's end), after from the next attempt's first step; times in seconds from the throttle "
             f"(bench/slow.py); back: the first step line from which the rate over {s['window_s']:g} s is at least "
             f"{s['back_share']:.0%} of the healthy one.", ""]
    cells = []
    for row in s["rows"]:
        for way, r in (("slow in restarts.on", row["acting"]), ("left slow", row["left_slow"])):
            healthy = r["healthy_steps_per_s"]
            cells.append([row["target"], way, _num(healthy, 1),
                          f"{_num(r['slowed_steps_per_s'], 1)} ({_ratio(r['slowed_steps_per_s'], healthy)})",
                          f"{_num(r['after_steps_per_s'], 1)} ({_ratio(r['after_steps_per_s'], healthy)})"
                          if r["after_steps_per_s"] is not None else "-",
                          _num(r["named_s"], 1), _num(r["weighed_s"], 1), _num(r["action_s"], 1),
                          _num(r["first_step_s"], 1), _num(r["back_s"], 1),
                          "-" if r["steps_redone"] is None else r["steps_redone"],
                          " -> ".join(f"{a['world_size']} on {','.join(a['hosts'])}" for a in r["attempts"]),
                          _num(r["onset_vs_throttle_s"], 1), _num(r["goodput"]["seconds"].get("slowed"), 1),
                          r["end_to_end_s"]])
    lines += _table(["target", "run", "healthy", "slowed", "after", "named", "weighed", "action", "next first step",
                     f"back to {s['back_share']:.0%}", "steps redone", "attempts (world size on hosts)",
                     "onset dated - throttle", "goodput's slowed", "end to end"], cells)
    lines += [f"{row['target']}: the job ended {row['saved_s']:g} s sooner than left slow." for row in s["rows"]]
    lines += ["", "The restarts as their records tell them (summary.json's attempts[1].restart, from the fault: the "
              "weighing that stopped the job; seconds):", ""]
    restarts = [(row["target"], row["acting"]["restart"]) for row in s["rows"] if row["acting"]["restart"]]
    phases = list(restarts[0][1]["phases"]) if restarts else []
    lines += _table(["target", "total", *phases], [[target, _num(r["total_s"], 2),
                                                    *(_num(r["phases"].get(p), 2) for p in phases)]
                                                   for target, r in restarts])
    lines += ["The weighing each run said:", ""]
    lines += [f"- {row['target']}, {way}: `{r['weighed']}`" for row in s["rows"]
              for way, r in (("slow in restarts.on", row["acting"]), ("left slow", row["left_slow"]))]
    return [*lines, "", *(f"Note: {n}" for n in s.get("notes", [])), *([""] if s.get("notes") else [])]


def _ratio(value: float | None, of: float | None) -> str:
    return f"{value / of:.2f}x" if value is not None and of else "-"


SECTIONS = (
    ("throughput", "1. Payload throughput vs the seed recipe", _throughput),
    ("tuning", "1b. Batch size and compile mode on the GPU", _tuning),
    ("ddp", "2. DDP overhead", _ddp),
    ("strategies", "2b. DDP against FSDP: throughput and memory at the same global batch", _strategies),
    ("first_step", "3. Harness overhead: launch to first step", _first_step),
    ("harness_cost", "3b. The harness's cost on the payload's img/s: harness launch against torchrun", _harness_cost),
    ("preflight", "4. Preflight fan-out", _preflight),
    ("failure", "5. Failure propagation", _failure),
    ("recovery", "6. Time to recover", _recovery),
    ("attach", "6b. A lost controller: `harness attach` against a relaunch", _attach),
    ("slurm", "7. Slurm: submit to first step, rank death to job end", _slurm),
    ("containers", "8. Containers: a node's start-up in the image vs on the bare host", _containers),
    ("hangs", "9. Hangs: detection time and culprit, against torchrun alone", _hangs),
    ("watch_cost", "10. The health watch's cost: img/s and time to first step", _watch_cost),
    ("stream", "11. The stream: a chatty job's lines, against torchrun --tee", _stream),
    ("metrics_cost", "12. Serving metrics to Prometheus: the controller's CPU", _metrics_cost),
    ("k8s", "13. Kubernetes: supervised pods against bare torchrun pods", _k8s),
    ("scale", "14. Scale: one controller, 16 to 256 nodes of stand-in ranks", _scale),
    ("slow", "15. A slow node: found, weighed and taken out, against leaving it slow", _slow),
)


def _run(name: str, result: dict[str, Any]) -> list[str]:
    lines = [f"## The {name} run", "", *_machine(result)]
    found = goals(result)  # from the measurements, so that a result file always shows today's goals
    if found:
        lines += ["### Goals", ""]
        lines += _table(["goal", "measured", ""], [[g["goal"], g["value"], _mark(g)] for g in found])
    for key, title, render in SECTIONS:
        bench = result["benchmarks"].get(key)
        if bench is None:  # not in this run's profile
            continue
        lines += [f"### {title}", ""]
        lines += _failed(bench) or render(bench)
    return lines


def markdown(latest: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python -m bench` (make bench / bench-quick / bench-gpu) from bench/results/latest-*.json; "
        "do not edit by hand. -->",
        "",
        "Measured side by side in one run: the payload against the seed recipe (bench/seed.py: fp32, PIL transforms "
        "through a DataLoader with a DistributedSampler), DDP against no DDP, FSDP against DDP, `harness launch` "
        "against plain torchrun (to the first step, and the payload's img/s under each), preflight over 1 to 16 hosts, "
        "failure propagation against torchrun alone, and the "
        "time a restarted run takes from a lost node to its next training step, Slurm: `harness launch --target slurm` "
        "against plain sbatch, a container node's start-up against the bare host, and hang detection against torchrun "
        "alone. Comparisons of two launchers run in interleaved rounds and give the 95% interval of their difference "
        "(or ratio); a goal is judged on that interval, undecided while it holds the goal. `make bench` is the full "
        "run (ResNet-18, repeats and rounds, 16 hosts, Slurm, containers, the stream, older packages side by side); "
        "`make bench-quick` takes about a minute on 2 cores (the smallest meaningful case of benchmarks 1, 3b, 4, 5 "
        "and 6: the small model, few steps, 2 rounds, 1 and 4 hosts); `make bench-launch` is the launch against "
        "torchrun by hand alone (benchmark 3 in up to 30 rounds, then the stream, 11); `make bench-gpu` is the "
        "GPU's share alone (benchmarks "
        "1, 1b, 2, 2b and 3b on CUDA); `make bench-health` is the health watch's alone (benchmarks 9 and 10: hung jobs "
        "found and their culprit named, against torchrun alone; the watch's cost); `make bench-attach` is a lost "
        "controller's alone (benchmark 6b: `harness attach` against a relaunch, and an SSH link cut); `make "
        "bench-slow` a slow node's (benchmark 15: found, weighed and taken out, against leaving it slow). Each run "
        "writes `bench/results/<time>-<host>-<profile>.json`; the tables below come from the latest of each. Shared or "
        "busy machines give noisy figures: check the load average below.",
        "",
    ]
    if not latest:
        return "\n".join([*lines, "No results yet: run `make bench`.", ""])
    gpu_runs = [r for r in latest.values() if r["machine"]["gpus"]]
    if not gpu_runs:
        lines += [
            "**Open: every GPU figure.** These runs had no GPU, so benchmarks 1, 2 and 2b ran on the CPU. Still to "
            f"measure on an H100-class GPU (`make bench-gpu` there, or `python -m bench --gpu`): the payload at "
            f">= {SEED_GOAL:g}x the seed recipe's img/s, >= {H100_GOAL:,} img/s for ResNet-18-CIFAR bf16 on one "
            "H100, MFU against 989 TFLOP/s dense bf16, the seed recipe's DataLoader ceiling with the GPU machine's "
            "CPU workers, `--compile` and its modes on the GPU, DDP and FSDP over NCCL (2 ranks need 2 GPUs), and the "
            "harness's cost on the payload's img/s (3b: `harness launch` against torchrun, at most 1%).",
            "",
        ]
    for name in ("gpu", "full", "quick", "launch", "health", "attach", "k8s", "scale", "slow"):
        if name in latest:
            lines += _run(name, latest[name])
    return "\n".join(lines).rstrip("\n") + "\n"


def summary(result: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    out = [f"{result['profile']} run: {result['duration_s']} s"]
    for g in result.get("goals", []):
        out.append(f"  {_mark(g)}\n      {g['goal']}: {g['value']}")
    for name, bench in result["benchmarks"].items():
        if "error" in bench:
            out.append(f"  FAILED {name}: {bench['error']}")
    return "\n".join(out)
