"""The results as Markdown: ``RESULTS.md`` beside the JSON files, and the performance page
``docs/performance.md``, both generated from the saved results (``python -m benchmarks
--report-only`` writes them again; the README keeps only the headline numbers and a link).
The reading under each table is computed from the same numbers: every target is checked
here, not by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import library, overhead, recovery, serve, snapshot
from benchmarks.stats import markdown_table, summarize

RATIO_TARGET = 0.99
LINK_DETECT_TARGET_S = 0.1
LINK_RUNNING_TARGET_S = 1.0
KILL_MARGIN_TARGET_S = 1.0
#: Generated scenarios per minute ``ftkit explore`` reaches, per tensor parallel size.
EXPLORE_TARGETS_PER_MIN = {1: 20.0, 2: 6.0}
#: Under a server: a warm standby's takeover after a worker's SIGKILL, until every running
#: stream's next token (a cold replacement's target is the engine's start plus
#: ``KILL_MARGIN_TARGET_S``).
STANDBY_TAKEOVER_TARGET_S = 1.0
#: The page ``make bench`` writes (relative to the repository root); the README links to it.
PAGE = Path("docs") / "performance.md"
PAGE_TITLE = "# Performance"


def load(out_dir: Path) -> dict[str, dict[str, Any]]:
    results = {}
    for name in ("overhead", "snapshot", "recovery", "library", "explore", "serve"):
        path = out_dir / f"{name}.json"
        if path.is_file():
            results[name] = json.loads(path.read_text())
    return results


def write(out_dir: Path, page: Path | None = None) -> str:
    """Write ``RESULTS.md`` in ``out_dir`` and, when given and there are results, the
    performance page ``page`` (all of it: the page is generated); return the Markdown."""
    results = load(out_dir)
    markdown = render(results)
    (out_dir / "RESULTS.md").write_text("# ftkit benchmark results\n\n" + markdown + "\n")
    if page is not None and results:
        page.write_text(render_page(markdown))
    return markdown


def render_page(markdown: str) -> str:
    """The performance page around the rendered results."""
    return (f"{PAGE_TITLE}\n\n<!-- Written by `make bench` (benchmarks/report.py) from "
            f"benchmarks/results/; do not edit by hand. -->\n\n{markdown}\n\n"
            f"Back to the [README](../README.md).\n")


def render(results: dict[str, dict[str, Any]]) -> str:
    parts = [_intro(results)]
    if "overhead" in results:
        parts.append(_overhead(results["overhead"]))
    if "snapshot" in results:
        parts.append(_snapshot(results["snapshot"]))
    if "recovery" in results:
        parts.append(_recovery(results["recovery"]))
    if "library" in results:
        parts.append(_library(results["library"]))
    if "explore" in results:
        parts.append(_explore(results["explore"]))
    parts.append(_serve(results.get("serve")))
    return "\n\n".join(parts)


def _intro(results: dict[str, dict[str, Any]]) -> str:
    first = next(iter(results.values()), None)
    if first is None:
        return "No benchmark results yet: run `make bench`."
    m = first["machine"]
    loads = [f"{name} {r['machine']['load_avg_1m']:.1f} to {r['load_avg_1m_after']:.1f}"
             for name, r in results.items()]
    quick = " (`--quick`: few repeats, not for comparison)" if first.get("quick") else ""
    if len({r["machine"]["commit"] for r in results.values()}) == 1:
        commit = f"commit {m['commit']}, {m['when']}"
    else:
        commit = "commits " + ", ".join(
            f"{r['machine']['commit']} ({name}, {r['machine']['when']})"
            for name, r in results.items())
    return (f"`make bench` (`python -m benchmarks`, about 50 minutes; `--quick` for a smoke "
            f"run) measures on real vLLM engines and writes `benchmarks/results/` (JSON per "
            f"suite, `RESULTS.md`). These figures{quick}: {m['cpus']} CPU cores, vLLM "
            f"{m['vllm']}, torch {m['torch']}, {commit}; every cell is "
            f"the median with the range (min-max) of its repeats. One-minute load average "
            f"during each suite: {'; '.join(loads)} (above {m['cpus']} means something else "
            f"shared the cores; except after explore, whose own engine hosts, up to 12 kept "
            f"at once and all closed at its end, weigh in that last minute).")


# --- fault-free overhead --------------------------------------------------------------------------

def _overhead(result: dict[str, Any]) -> str:
    plan = result["plan"]
    rows = [(r["tp"], r["batch"], overhead.Row(r["tp"], r["batch"], r["tokens_per_s"],
                                                r["identical"]))
            for per_tp in result["results"] for r in per_tp["rows"]]
    met = [(tp, b) for tp, b, row in rows if row.ratio("ftkit").median >= RATIO_TARGET]
    missed = [(tp, b, row.ratio("ftkit")) for tp, b, row in rows
              if row.ratio("ftkit").median < RATIO_TARGET]
    legacy = summarize(row.ratio("legacy").median for _, _, row in rows)
    reading = [f"Target ftkit/off >= {RATIO_TARGET}: met in {len(met)} of {len(rows)} rows."]
    for tp, b, ratio in missed:
        inside = ratio.low <= 1.0 <= ratio.high
        reading.append(
            f"TP {tp}, batch {b}: {ratio.median:.3f}, range {ratio.low:.3f}-{ratio.high:.3f}"
            + (" (1.0 lies inside the range)." if inside else "."))
    spreads = [row.ratio("ftkit").high - row.ratio("ftkit").low for _, _, row in rows]
    reading.append(
        f"Resolution: within one row the per-repeat ratios of the same two engines spread by "
        f"{min(spreads):.2f} to {max(spreads):.2f} (max - min), so an end-to-end cost of a few "
        f"per cent is below what these repeats resolve on this machine. At TP 2 the `ftkit` "
        f"engine also runs its own interruptible shared-memory collectives in place of vLLM's.")
    own = result.get("own_time")
    if own and own["rows"]:
        parts = []
        for r in own["rows"]:
            share = r["share"]["median"] * 100
            parts.append(f"batch {r['batch']}: {r['ftkit_us']['median']:.1f} us of "
                         f"{r['runner_us']['median']:.0f} us ({share:.2f} %)")
        reading.append(
            "Measured where it is spent instead (second table: TP 1, in process, the whole "
            "wrapped step timed around the model runner's calls, every decode step of the same "
            "workload): ftkit adds per step " + "; ".join(parts) + ". This time depends on the "
            "requests a step schedules, not on the model: on a real model, whose step takes "
            "tens of milliseconds, the same microseconds are a far smaller share.")
    reading.append(f"The earlier design's per-step costs keep {legacy.median:.2f} of the "
                   f"plain engine's tokens per second (rows range {legacy.low:.2f}-"
                   f"{legacy.high:.2f}): {overhead.legacy_note(result)}.")
    return (f"### Fault-free overhead\n\n"
            f"The same greedy workload ({plan['max_tokens']} tokens per request) on three "
            f"engines side by side: `off` (plain vLLM), `ftkit` (recovery on) and `legacy` "
            f"(plain vLLM plus the earlier design's per-step costs: two full copies of the "
            f"token-id table, a world all-gather and a device synchronise per step, a 1 s "
            f"polling monitor; a benchmark-only plugin, `benchmarks/legacy_plugin`). All run "
            f"with max_num_seqs {plan['max_num_seqs']} and max_model_len "
            f"{plan['max_model_len']} (the token-id table is 32 MiB), {plan['repeats']} "
            f"repeats in rotating order; ratios are per repeat.\n\n"
            f"{overhead.table(result)}\n\n"
            + (f"{overhead.own_time_table(result)}\n\n" if result.get("own_time") else "")
            + "\n".join(f"- {r}" for r in reading))


# --- snapshot -------------------------------------------------------------------------------------

def _snapshot(result: dict[str, Any]) -> str:
    configs = result["results"]
    by_batch: dict[tuple[str, int], list[tuple[int, int, float]]] = {}
    for c in configs:
        for row in c["rows"]:
            if row["sample"].get("n"):
                by_batch.setdefault((row["sampling"], row["batch"]), []).append(
                    (c["max_model_len"], c["max_num_seqs"], row["sample"]["bytes"]))
    flat = [key for key, vals in by_batch.items()
            if len({s for _, _, s in vals}) == 1 and len(vals) > 1]
    greedy = sorted((b, vals[0][2]) for (kind, b), vals in by_batch.items()
                    if kind == "greedy")
    legacy = [(c["max_model_len"], c["max_num_seqs"], c["legacy"]["bytes_per_step"])
              for c in configs]
    reading = []
    if greedy:
        (b0, bytes0), (b1, bytes1) = greedy[0], greedy[-1]
        reading.append(f"A greedy step's record holds {bytes0:.0f} bytes at batch {b0} and "
                       f"{bytes1:.0f} at batch {b1}" + (": it does not grow with the requests "
                       "the step schedules." if bytes0 == bytes1 else "."))
    multi = [key for key, vals in by_batch.items() if len(vals) > 1]
    reading.append(
        f"Across max_model_len and max_num_seqs the record's bytes are identical for "
        f"{len(flat)} of {len(multi)} (sampling, batch) workloads measured at more than one "
        f"engine size" + ("." if len(flat) == len(multi) else
                          ": see the table for the others."))
    if legacy:
        lo, hi = min(legacy, key=lambda x: x[2]), max(legacy, key=lambda x: x[2])
        reading.append(f"The earlier design's copies grow with the table instead: "
                       f"{lo[2] / 2**20:.0f} MiB per step at {lo[0]} x {lo[1]}, "
                       f"{hi[2] / 2**20:.0f} MiB at {hi[0]} x {hi[1]}.")
    reading.append("The times are taken where the calls run, first thing in the RPC after a "
                   "forward pass, with cold caches: a few microseconds of each are the cache "
                   "misses of any code run there. Seeded sampling also copies every generator's "
                   "state (5 KiB each), per seeded request; never the logits (a fault while "
                   "sampling re-runs the step's forward pass).")
    return ("### Snapshot cost\n\n"
            "The per-step rollback record (`V1RunnerState.begin_sample`; `execute_model` takes "
            "none: its rollback is derived from its scheduler output), timed around the real "
            "call on the runner state of an in-process engine (tensor parallel 1, recovery "
            "on), steady decode steps only; bytes are what the record allocates (containers "
            "and copied tensors, not what it refers to). The legacy "
            "columns time the earlier design's two clones of the token-id table on the same "
            "runner.\n\n" + snapshot.table(result) + "\n\n"
            + "\n".join(f"- {r}" for r in reading))


# --- recovery ---------------------------------------------------------------------------------

def _recovery(result: dict[str, Any]) -> str:
    reading = []
    link = next((r for r in result["in_place"] if r["case"] == "link_break" and r["tp"] == 2),
                None)
    if link is not None:
        detect = recovery.phase_summary(link["faults"], "detect")
        total = recovery.phase_summary(link["faults"], "total")
        if detect is not None and total is not None:
            reading.append(
                f"Link break at TP 2: detected on every rank after {detect.median * 1000:.0f} "
                f"ms (worst {detect.high * 1000:.0f} ms; target {LINK_DETECT_TARGET_S * 1000:.0f}"
                f" ms: {_met(detect.high <= LINK_DETECT_TARGET_S)}), generation running again "
                f"after {total.median * 1000:.0f} ms (worst {total.high * 1000:.0f} ms; target "
                f"{LINK_RUNNING_TARGET_S:g} s: {_met(total.high <= LINK_RUNNING_TARGET_S)}).")
    slowest = _slowest_phases(result)
    if slowest:
        reading.append("Where the time goes: " + "; ".join(slowest) + ".")
    kill = result.get("process_kill")
    if kill and kill["kills"]:
        timed = [k for k in kill["kills"] if k.get("start") is not None
                 and k.get("total") is not None]
        if timed:
            m = summarize(k["total"] - k["start"] for k in timed)
            start = summarize(k["start"] for k in timed)
            first = recovery.phase_summary(kill["kills"], "first_token")
            parts = {"noticing the death": "watch", "shutting the dead engine down": "close",
                     "resubmitting the requests": "resume"}
            medians = {name: recovery.phase_summary(kill["kills"], col)
                       for name, col in parts.items()}
            biggest = max((n for n in medians if medians[n] is not None),
                          key=lambda n: medians[n].median, default=None)
            reading.append(
                f"Process kill at TP {kill['tp']}: requests resumed {m.median:.2f} s (worst "
                f"{m.high:.2f} s) after the kill plus the new engine's start time "
                f"({start.median:.1f} s); target {KILL_MARGIN_TARGET_S:g} s: "
                f"{_met(m.high <= KILL_MARGIN_TARGET_S)}." +
                (f" The largest part of the margin is {biggest} "
                 f"({medians[biggest].median:.2f} s)." if biggest else "") +
                (f" The new engine's first token then takes another {first.median:.1f} s "
                 f"(its first steps)." if first is not None else ""))
    return ("### Recovery latency\n\n"
            f"Real faults on real engines, {result['plan']['faults']} per kind (one workload "
            "of 8 requests x 64 tokens carries them, a fault every 6 steps, ranks in turn), "
            "laid out on the machine's clock from the fault's `fault_fired` event (see "
            "`benchmarks/recovery.py`): `detect` until every rank knew, `stop` until every "
            "rank had joined the round, `agree` until all reports were in, `device`, `comms` "
            "and `repair` the rebuild (device on the slowest rank, comms on the last to "
            "arrive: the rebuild is collective), `restore` the rollback plus any KV "
            "recompute, `rerun` the step itself, `total` until the re-run returned on every "
            "rank. Milliseconds.\n\n" + recovery.table(result) + "\n\n"
            + recovery.kill_table(result) + "\n\n" + "\n".join(f"- {r}" for r in reading))


def _slowest_phases(result: dict[str, Any]) -> list[str]:
    notes = []
    for row in result["in_place"]:
        phases = {p: recovery.phase_summary(row["faults"], p) for p in recovery.PHASES[:-1]}
        phases = {p: s for p, s in phases.items() if s is not None}
        if not phases:
            continue
        worst = max(phases, key=lambda p: phases[p].median)
        notes.append(f"{row['case']} (TP {row['tp']}) {worst} "
                     f"{phases[worst].median * 1000:.0f} ms")
    return notes


def _stall_ms(stalled: float | None) -> str:
    """What of a client-visible gap the clients' own process spent not run (``Stalls``)."""
    return f", {stalled * 1000:.0f} ms of it the clients' process not run" if stalled else ""


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


# --- the scenario library -----------------------------------------------------------------------

def _library(result: dict[str, Any]) -> str:
    runs = result["runs"]
    reading = []
    for r in runs:
        parts = {"engine starts": r["engine_start_s"], "restarts after kills": r["restart_s"],
                 "generation and the rest": r["other_s"], "startup": r["startup_s"] or 0.0,
                 "shutdown": r["shutdown_s"]}
        top = max(parts, key=lambda k: parts[k])
        reading.append(f"{r['label']}: {r['wall_s']:.0f} s for {r['scenarios']} scenarios; "
                       f"{top} the largest part ({parts[top]:.0f} s, "
                       f"{100 * parts[top] / r['wall_s']:.0f} %).")
    return (f"### Scenario library\n\n`ftkit run {result['target']}`, first with an empty cache "
            f"(`FTKIT_CACHE_DIR` a fresh directory: model built, every baseline computed), "
            f"then again with the cache it left. Seconds.\n\n" + library.table(result)
            + "\n\n" + "\n".join(f"- {r}" for r in reading))


# --- the chaos search -------------------------------------------------------------------------

def _explore(result: dict[str, Any]) -> str:
    rows, reading = [], []
    for c in result["campaigns"]:
        target = EXPLORE_TARGETS_PER_MIN.get(c["tp"])
        met = "-" if target is None else _met(c["per_minute"] >= target)
        rows.append([c["tp"], f"{c['budget_s']:g} s", c["scenarios_run"],
                     f"{c['per_minute']:.1f}", "-" if target is None else f"{target:g}", met,
                     f"{c['wall_per_minute']:.1f}", _mean_median(c),
                     f"{c['engine_starts']} ({c['engine_start_s']:.0f} s)",
                     f"{100 * c['kill_share']:.0f} % ({c['kill_runs']} runs)",
                     c["shrink_runs"], len(c["failures"])])
        reading.append(_explore_reading(c, target))
    if result.get("quick"):
        reading.append("A `--quick` budget: the engine starts weigh more in it than in a "
                       "campaign of minutes.")
    return ("### Explore (chaos search) throughput\n\n"
            f"`ftkit explore --seed {result['campaigns'][0]['seed']} --tp N` in process, one "
            "campaign per tensor parallel size, on engines kept between scenarios and a fresh "
            "baseline cache (`FTKIT_CACHE_DIR` an empty directory, the model built before the "
            "campaign; a baseline computed in the campaign is then read from the cache). `per "
            "minute`: generated scenarios per minute of their own run time, the rate `ftkit "
            "explore` reports and the target is checked on; `wall /min`: per minute of the "
            "campaign's wall time (Hypothesis and shrinking included). `kill share`: the "
            "part of the run time in runs with a `process_kill` fault (an engine restart "
            "each).\n\n"
            + markdown_table(["TP", "budget", "scenarios", "per minute", "target", "met?",
                              "wall /min", "run s mean (median)", "engine starts",
                              "kill share", "shrink runs", "failures"], rows)
            + "\n\n" + "\n".join(f"- {r}" for r in reading))


def _mean_median(c: dict[str, Any]) -> str:
    if c["run_s_mean"] is None:
        return "-"
    return f"{c['run_s_mean']:.1f} ({c['run_s_median']:.1f})"


def _explore_reading(c: dict[str, Any], target: float | None) -> str:
    text = f"TP {c['tp']}: {c['per_minute']:.1f} scenarios per minute"
    if target is not None:
        text += f" (target {target:g}: {_met(c['per_minute'] >= target)})"
    if c["generation_s"] > 0:
        text += (f"; engine starts took {c['engine_start_s']:.0f} s of the "
                 f"{c['generation_s']:.0f} s of run time "
                 f"({100 * c['engine_start_s'] / c['generation_s']:.0f} %: "
                 f"{c['engine_starts']} starts for {c['engine_configs']} engine "
                 f"configuration{'' if c['engine_configs'] == 1 else 's'}, plain and with "
                 f"ftkit)")
    if c["requests_mean"] is not None:
        text += (f"; the workloads averaged {c['requests_mean']:.1f} requests x "
                 f"{c['max_tokens_mean']:.0f} tokens ({c['at_4x32']} of "
                 f"{c['scenarios_run']} at the issue's stated shape, 4 x 32)")
    text += f"; {c['baselines_cached']} baselines came from the campaign's cache"
    if c["failures"]:
        text += (f"; {len(c['failures'])} failure(s), shrunk in {c['shrink_runs']} runs: "
                 + "; ".join(f"`{s}`" for s in c["failures"]))
    else:
        text += "; no failure"
    return text + "."


# --- serving ----------------------------------------------------------------------------------

SERVE_INTRO = (
    "### Serving\n\n"
    "`benchmarks/serve.py`: vLLM's OpenAI server with ftkit's plugin (started as `ftkit serve` "
    "starts it: the tiny model, TP 2, eager), driven by concurrent streaming `openai` clients, "
    "each on a connection of its own (greedy, `ignore_eos`). Servers differ only in their "
    "`fault_tolerance` settings: `off` (`enabled: false`) and `on` (`enabled: true`), both "
    "up at once and driven in turn (alternating which goes first; the one not measured "
    "stopped with `SIGSTOP` meanwhile, as idle it took 2-3 % of a core; for the second half "
    "of the repeats both started anew, in the other order, as the server started second ran "
    "faster, and the target is checked on the geometric mean of the halves' medians, where "
    "that cancels; every stream released "
    "into the paused engine at once; tokens per second in the engine, from vLLM's own "
    "`/metrics` series: tokens generated per second of the requests' mean time from first "
    "scheduled to last token, the target checked on this; and as the clients read them, from "
    "the release to the last token read; the ratio per repeat). The same on and off servers "
    "again with the wide model (`ftkit.model.wide`: the layer widths of a 7B-class Llama, two "
    "layers; TP 2): a step of the tiny model takes a few milliseconds, and its front end and "
    "clients, sharing the two cores, take as much of them as the engine, so its ratio "
    "measures their contention more than recovery's cost; the wide model's step is long "
    "enough for the engine to weigh most, as in a deployment. Then on a `faults` server "
    "(`enabled`, `injection`, `max_restarts: 1`), per fault kind, one fault planned through "
    "the injection route (`POST /ftkit/inject`, what `ftkit inject` sends) for one client's "
    "`X-Request-Id` and token: the "
    "largest gap between two tokens any client saw, and whether every stream's token ids and "
    "logprobs equal the same server's fault-free run; then SIGKILL of the serving engine's "
    "`Worker_TP1` while the streams run (the engine paused, with vLLM's development route "
    "`POST /pause?mode=keep`, until the server had every stream's request; then a "
    f"`process_kill` planned through the injection route {serve.KILL_AFTER_STEPS} of the "
    f"server's steps on, and `POST /resume`: every stream {serve.KILL_AFTER_STEPS} tokens in "
    "at the kill), replaced by a new "
    "engine (`cold`) "
    "and, on a server with `standby: true`, by the warm standby: the time from the kill until "
    "every stream the server resumed had its first output from the new engine, on the server "
    "(ftkit's `RequestResumed` events, as that output goes into the stream; the targets are "
    "checked on this) and at the clients (the new engine's first token read), and the streams "
    "that failed. Last, the idle cost of each engine of the standby server (its engine core "
    "and workers: RSS, USS, CPU) while no request runs. The clients share the cores with the "
    "server: what a client sees includes its own delays (the fault-free row shows them).")


def _serve(result: dict[str, Any] | None) -> str:
    if result is None:
        return (SERVE_INTRO + "\n\nNo results yet: `python -m benchmarks --only serve` "
                "(about 15 minutes).")
    reading = []
    for key, model, *_ in serve.THROUGHPUTS:
        t = result.get(key)
        if not t:
            reading.append(f"Tokens per second, {model} model: not in these results (`python "
                           f"-m benchmarks --only serve` measures it).")
            continue
        in_engine = "engine_ratios" in t  # (results from before the engine's series were read)
        ratio = summarize(t["engine_ratios" if in_engine else "ratios"])
        halves = t.get("halves", [])
        balanced = serve.order_balanced(halves)
        checked = ratio.median if balanced is None else balanced
        how = (f"median {ratio.median:.3f}" if balanced is None else
               f"{balanced:.3f}, the geometric mean of the two halves' medians, "
               + " and ".join(f"{summarize(h['engine_ratios']).median:.3f} with "
                              f"{h['started'][0]} started first" for h in halves)
               + f"; median of all {ratio.median:.3f}")
        reading.append(
            f"Tokens per second{' in the engine' if in_engine else ''}, {model} model, on/off "
            f">= {RATIO_TARGET}: {_met(checked >= RATIO_TARGET)}"
            f" ({how}, repeats {ratio.low:.3f}-{ratio.high:.3f}"
            + (", 1.0 inside the range" if ratio.low <= 1.0 <= ratio.high else "") + ")"
            + (f"; as the clients read them, {summarize(t['ratios']).median:.3f}"
               if in_engine else "") + ".")
    faults = result.get("faults")
    if faults:
        rows = faults["rows"]
        exact = [r["case"] for r in rows if not r["mismatched"] and not r["failed_streams"]
                 and r["fired"] == r["planned"]]
        worst = max((r for r in rows if r["largest_gap_s"] is not None),
                    key=lambda r: r["largest_gap_s"], default=None)
        reading.append(
            f"Faults through the live route: {len(exact)} of {len(rows)} kinds fired as "
            f"planned with every stream identical to the fault-free run"
            + (f"; the largest client-visible gap {worst['largest_gap_s'] * 1000:.0f} ms "
               f"({worst['case']}{_stall_ms(worst.get('largest_gap_stalled_s'))}; "
               f"fault-free {faults['reference_gap_s'] * 1000:.0f} ms"
               f"{_stall_ms(faults.get('reference_gap_stalled_s'))})"
               if worst is not None and faults["reference_gap_s"] else "") + ".")
        if faults["reference_repeat_mismatched"]:
            reading.append(f"A second fault-free run differed from the first in "
                           f"{len(faults['reference_repeat_mismatched'])} streams: the oracle "
                           f"is not sound on this run.")
    start = result.get("engine_start_s")
    for k in result.get("kills", []):
        # On the server where measured (the clients read late on shared cores).
        server_side = "server_all_resumed_s" in k
        took = k["server_all_resumed_s"] if server_side else k["all_resumed_s"]
        if k["mode"] == "cold":
            # The engine start the replacement is held to: its own (the same start, under the
            # same load: the clients still read the streams' backlog during it), where the
            # log gave it; the server's first engine's, at launch, beside it.
            own = k.get("replacement_start_s")
            base = own if own is not None else start
            target = None if base is None else base + KILL_MARGIN_TARGET_S
            named = "the new engine's own start" if own is not None else "engine start"
            what = (f"{named} + {KILL_MARGIN_TARGET_S:g} s = "
                    + ("-" if target is None else f"{target:.2f} s")
                    + (f"; the server's first engine started in {start:.2f} s, at launch"
                       if own is not None and start is not None else ""))
        else:
            target = STANDBY_TAKEOVER_TARGET_S
            what = f"< {target:g} s"
        ok = took is not None and target is not None and (
            took <= target if k["mode"] == "cold" else took < target)
        by_server = k.get("resumed_by_server", k["resumed"])
        if took is not None and server_side:
            clients = []
            if k["all_resumed_s"] is not None:
                clients.append(f"its next token at the clients after {k['all_resumed_s']:.2f} s")
            if k.get("client_resume_gap_s") is not None:
                clients.append(f"the largest gap a client read across the resume "
                               f"{k['client_resume_gap_s']:.2f} s")
            if k.get("clients_behind_s") is not None and k["clients_behind_s"] > 0:
                clients.append(f"the clients read the dead engine's last tokens up to "
                               f"{k['clients_behind_s']:.2f} s after the kill")
            if k.get("clients_stalled_s"):
                clients.append(f"meanwhile the clients' own process was not run for "
                               f"{k['clients_stalled_s']:.2f} s (longest "
                               f"{k['clients_longest_stall_s']:.2f} s)")
            shown = (f"every resumed stream had its next output from the server {took:.2f} s "
                     f"after the kill" + (f" ({'; '.join(clients)})" if clients else ""))
        elif took is not None:
            shown = f"every resumed stream's next token {took:.2f} s after the kill"
        elif not by_server:
            shown = ("no stream was resumed (none ran in the engine across the kill: the "
                     "streams had finished there, or had not started)")
        else:
            shown = (f"{by_server - k['resumed']} of {by_server} resumed streams delivered no "
                     f"token of the new engine")
        reading.append(f"SIGKILL of {serve.KILL_TARGET}, {k['mode']} replacement: {shown} "
                       f"(target {what}: {_met(ok)}); {k['failed_streams']} of {k['streams']} "
                       f"streams failed (target 0: {_met(k['failed_streams'] == 0)})"
                       + (f": {k['errors'][0][:80]}" if k["errors"] else "") + ".")
    idle = result.get("idle")
    if idle and len(idle["engines"]) == 2:
        serving, standby = idle["engines"]
        reading.append(
            f"Idle, the standby holds {standby['rss_bytes'] / 2**20:.0f} MiB RSS "
            f"({standby['uss_bytes'] / 2**20:.0f} MiB its own) and uses "
            f"{standby['cpu_percent']:.1f} % of a core; the serving engine "
            f"{serving['rss_bytes'] / 2**20:.0f} MiB ({serving['uss_bytes'] / 2**20:.0f} MiB) "
            f"and {serving['cpu_percent']:.1f} %.")
    measured = any(result.get(key) for key, *_ in serve.THROUGHPUTS)
    tables = [serve.throughput_table(result) if measured else "",
              serve.fault_table(result) if faults else "",
              serve.kill_table(result) if result.get("kills") else "",
              serve.idle_table(result) if idle else ""]
    return (SERVE_INTRO + "\n\n" + "\n\n".join(x for x in tables if x) + "\n\n"
            + "\n".join(f"- {r}" for r in reading))
