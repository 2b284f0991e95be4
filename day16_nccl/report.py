"""What the benchmark prints and writes: the nccl-tests-style table, the busbw table, CSV, PNGs,
the ring / built-in ratio, and the alpha-beta fit with its prediction errors (rank 0 only)."""

from __future__ import annotations

import json
import math
import os
import statistics

import torch

from day16_nccl import cost_model
from dtl import dist as dtl_dist
from dtl.metrics import write_csv

HEADER = (
    f"{'op':<20}{'size (B)':>12}{'count':>11}{'type':>9}{'time (us)':>12}"
    f"{'algbw GB/s':>12}{'busbw GB/s':>12}{'#wrong':>8}{'p25 (us)':>11}{'p75/p25':>9}"
)
MODEL_FILE = "cost_model.json"  # the fitted alpha and beta, for later days to predict with
MODEL_ALGOS = {"ring_all_reduce": "ring", "tree_all_reduce": "tree", "dbt_all_reduce": "dbt"}
# busbw on one rank: its factor is 0 (2(n-1)/n, (n-1)/n) or meaningless (broadcast to yourself)
NO_LINK = "n/a (1 rank: nothing crosses a link)"


def _bw(value: float | None, width: int) -> str:
    return f"{value:>{width}.3f}" if value is not None else f"{'n/a':>{width}}"


def format_row(r: dict) -> str:
    return (
        f"{r['op']:<20}{r['nbytes']:>12}{r['count']:>11}{r['dtype']:>9}{r['time_us']:>12.1f}"
        f"{r['algbw']:>12.3f}{_bw(r['busbw'], 12)}{r['wrong']:>8}"
        f"{r['p25_us']:>11.1f}{r['spread']:>9.2f}"
    )


def print_env(info) -> None:
    nccl = {k: os.environ.get(k, "") for k in ("NCCL_ALGO", "NCCL_PROTO") if os.environ.get(k)}
    dtl_dist.print0(
        f"world: {info.world_size} ranks, backend {info.backend}, torch "
        f"{torch.__version__}" + (f", {nccl}" if nccl else "")
    )
    if nccl and info.backend != "nccl":
        dtl_dist.print0("note: NCCL_ALGO / NCCL_PROTO only steer NCCL; gloo ignores them")
    elif nccl and info.world_size == 1:
        dtl_dist.print0(
            "note: NCCL_ALGO / NCCL_PROTO change nothing on 1 rank: NCCL runs no ring or tree "
            "there, only a local copy"
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:g} KiB"


def busbw_table(rows: list[dict]) -> str:
    if all(r["busbw"] is None for r in rows):
        return f"busbw (GB/s): {NO_LINK}"
    ops = list(dict.fromkeys(r["op"] for r in rows))
    sizes = sorted({r["nbytes"] for r in rows if r["op"] == ops[0]}) if ops else []
    by = {(r["op"], r["nbytes"]): r["busbw"] for r in rows}
    lines = ["busbw (GB/s)".ljust(20) + "".join(f"{_mib(s):>10}" for s in sizes)]
    for op in ops:
        lines.append(
            f"{op:<20}"
            + "".join(_bw(by[(op, s)], 10) if (op, s) in by else f"{'-':>10}" for s in sizes)
        )
    return "\n".join(lines)


def ring_ratio(rows: list[dict]) -> dict[int, float | None]:
    """Hand-written ring busbw / built-in all_reduce busbw, at 16 and 64 MiB when measured;
    None on 1 rank, where neither has a busbw (and the ring runs 0 rounds)."""
    by = {(r["op"], r["nbytes"]): r["busbw"] for r in rows}
    out: dict[int, float | None] = {}
    for s in (16 * 2**20, 64 * 2**20):
        if ("ring_all_reduce", s) not in by or ("all_reduce", s) not in by:
            continue  # not measured at this size
        ring, built_in = by[("ring_all_reduce", s)], by[("all_reduce", s)]
        out[s] = None if ring is None or built_in is None else ring / built_in
    return out


def model_report(rows: list[dict], cfg, cores: int | None) -> tuple[list[str], dict | None]:
    """Fit alpha and beta on the hand-written all-reduces' 25th-percentile times (ring, tree and
    dbt together: two numbers for three algorithms); print each prediction beside its measurement.
    The 25th percentile, not the median: on a shared box single calls have a heavy tail (a core
    another job holds for a scheduler slice), and the quiet end of the repetitions is what the
    model describes; the spread p75/p25 says how heavy that tail was."""
    pts = [
        dict(algo=MODEL_ALGOS[r["op"]], nbytes=r["nbytes"], n=r["n"], time_s=r["p25_us"] / 1e6)
        for r in rows
        if r["op"] in MODEL_ALGOS and r["dtype"] == "float32"
    ]
    if pts and pts[0]["n"] < 2:
        return [
            "cost model: not fitted: on 1 rank every schedule is 0 rounds and 0 bytes, so "
            "t = 0 * alpha + 0 / beta and the times (pure overhead) say nothing about alpha or "
            "beta; run on >= 2 ranks"
        ], None
    if len({p["nbytes"] for p in pts}) < 2:
        return [
            "cost model: not fitted: needs >= 2 sizes of the hand-written all-reduces in float32"
        ], None
    chunk, n = cfg.chunk_kib * 1024, pts[0]["n"]
    alpha, beta = cost_model.fit(pts, 4, chunk, cores)
    view = (
        "links (B = busiest sender)"
        if cores is None
        else (f"{cores} CPU cores (B = max(busiest rank's sent+received, everyone's / {cores}))")
    )
    lines = [
        f"cost model t = steps * alpha + B / beta, per round: {view}",
        f"fitted on {len(pts)} 25th-percentile times: alpha = {alpha * 1e6:.1f} us, "
        f"beta = {beta / 1e9:.3f} GB/s",
        *(
            []
            if math.isfinite(beta)
            else [
                "beta = inf: the times did not grow with the message size here (too few or too "
                "noisy sizes to see a bandwidth term); the fit kept alpha alone (try --reps=9)"
            ]
        ),
        f"{'algo':<6}{'size':>9}{'steps':>7}{'B/S':>7}{'measured us':>13}{'model us':>10}"
        f"{'error':>7}  closed form",
    ]
    errors: dict[str, list[float]] = {}
    for p in sorted(pts, key=lambda p: (p["algo"], p["nbytes"])):
        steps, b = cost_model.critical_bytes(p["algo"], p["nbytes"] // 4, n, 4, chunk, cores)
        pred = steps * alpha + b / beta
        err = (pred - p["time_s"]) / p["time_s"]
        lines.append(
            f"{p['algo']:<6}{_mib(p['nbytes']):>9}{steps:>7}{b / p['nbytes']:>7.2f}"
            f"{p['time_s'] * 1e6:>13.0f}{pred * 1e6:>10.0f}{err:>+7.0%}  "
            + _closed_form(p["algo"], alpha, beta, p["nbytes"], n, chunk, cores)
        )
        if p["nbytes"] >= cfg.fit_min_bytes:
            errors.setdefault(p["algo"], []).append(abs(err))
    lines += pipeline_depth_lines(alpha, beta, max(p["nbytes"] for p in pts), n, chunk, cores)
    lines += crossover_lines(alpha, beta, n, chunk, cores)
    path = os.path.join(cfg.out_dir, "cost_model.png")
    cost_model.plot(pts, alpha, beta, path, chunk, cores)
    fit = dict(alpha_s=alpha, beta_bytes_per_s=beta, n=n, cores=cores, chunk_bytes=chunk)
    with open(os.path.join(cfg.out_dir, MODEL_FILE), "w") as f:
        json.dump(fit, f, indent=2)  # day 17 predicts its buckets' all-reduces from this fit
    lines.append(f"wrote {path}, {os.path.join(cfg.out_dir, MODEL_FILE)}")
    return lines, dict(alpha=alpha, beta=beta, n=n, errors=errors)


def pipeline_depth_lines(
    alpha: float, beta: float, nbytes: int, n: int, chunk: int, cores: int | None
) -> list[str]:
    """The tree's chunk count k at the largest size, three ways: the textbook closed form (links,
    every round costing alpha + m S/(k beta)), the minimum of the links-view model of the real
    schedule, and the minimum of the view fitted here; and what the default chunk costs."""
    out = [f"pipeline depth k at {_mib(nbytes)} (default chunk_kib = {chunk // 1024}):"]
    for algo in ("tree", "dbt"):
        k, d = cost_model.pipeline_shape(algo, nbytes, n, chunk)
        formula = cost_model.k_star(alpha, beta, algo, nbytes, n)
        links = cost_model.best_chunks(alpha, beta, algo, nbytes, n, None)
        here = cost_model.best_chunks(alpha, beta, algo, nbytes, n, cores)
        at_k = cost_model.predict_at_k(alpha, beta, algo, nbytes, n, k, cores) * 1e6
        at_best = cost_model.predict_at_k(alpha, beta, algo, nbytes, n, here, cores) * 1e6
        view = "links" if cores is None else f"{cores} CPU cores"
        out.append(
            f"  {algo}: k* = sqrt((2D-1) m S/(a b)) = {formula:.1f} (D = {d}, links); "
            f"links-view model's best k = {links}; {view} view's best k = {here}; "
            f"model at the default k = {k}: {at_k:.0f} us, at k = {here}: {at_best:.0f} us"
        )
    return out


def crossover_lines(alpha: float, beta: float, n: int, chunk: int, cores: int | None) -> list[str]:
    """Where the model puts tree/dbt ahead of ring. Links view (GPU runs): for this n and for
    8, 64 and 512 ranks. CPU view: for this n only; a fit of 2 cores says nothing about n = 512."""
    ranks = sorted({n, 8, 64, 512}) if cores is None else [n]
    out = []
    for algo in ("tree", "dbt"):
        for m in ranks:
            x = cost_model.crossover_bytes(alpha, beta, m, algo, chunk, cores)
            view = "links view" if cores is None else f"{cores}-core view"
            out.append(
                f"model ({view}, this alpha and beta; NCCL's tuner has its own): {algo} beats "
                f"ring at n = {m} for S <= {_mib(x) if x else 'never (1 KiB .. 16 GiB)'}"
            )
    if cores is not None:
        out.append("model: crossovers at n = 8 .. 512 are printed in the links view (GPU runs)")
    return out


def _closed_form(
    algo: str, alpha: float, beta: float, nbytes: int, n: int, chunk: int, cores: int | None
) -> str:
    if algo == "ring":
        f, t = cost_model.ring_factor(n, cores), cost_model.ring_time(alpha, beta, nbytes, n, cores)
        return f"2(n-1)(a + {f:g} S/(n b)) = {t * 1e6:.0f} us"
    k, d = cost_model.pipeline_shape(algo, nbytes, n, chunk)
    return f"k + 2D - 1 = {k} + 2*{d} - 1 rounds"


def plot_busbw(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "busbw" if rows[0]["busbw"] is not None else "algbw"  # 1 rank: no busbw, show algbw
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = [(r["nbytes"], r[key]) for r in rows if r["op"] == op]
        ax.plot(*zip(*pts), "o-" if op in ("all_reduce", "ring_all_reduce") else ".--", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel(f"{key} (GB/s)")
    note = "" if key == "busbw" else f"; busbw {NO_LINK}"
    ax.set_title(f"{key} on {rows[0]['n']} ranks ({rows[0]['dtype']}){note}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(cfg, rows: list[dict], final: bool, cores: int | None = None) -> None:
    """Tables, files and the `summary:` lines (rank 0)."""
    if dtl_dist.get_rank() != 0 or not rows:
        return
    os.makedirs(cfg.out_dir, exist_ok=True)
    if not final:  # Ctrl-C: the table so far and the CSV, nothing else
        print(HEADER + "\n" + "\n".join(format_row(r) for r in rows), flush=True)
        write_csv(rows, os.path.join(cfg.out_dir, "bench_partial.csv"))
        print(f"wrote {os.path.join(cfg.out_dir, 'bench_partial.csv')}", flush=True)
        return
    write_csv(rows, os.path.join(cfg.out_dir, "bench.csv"))
    plot_busbw(rows, os.path.join(cfg.out_dir, "busbw.png"))
    print("\n" + busbw_table(rows), flush=True)
    model_lines, model = model_report(rows, cfg, cores)
    print("\n".join(model_lines), flush=True)
    n, wrong = rows[0]["n"], sum(r["wrong"] for r in rows)
    print(
        f"summary: bench {len(rows)} rows on {n} ranks, {wrong} wrong elements "
        f"(every size checked against its closed form)",
        flush=True,
    )
    for s, ratio in ring_ratio(rows).items():
        shown = NO_LINK if ratio is None else f"{ratio:.2f}"
        print(
            f"summary: ring_all_reduce / built-in all_reduce busbw at {_mib(s)} = {shown}",
            flush=True,
        )
    spreads = sorted((r["spread"], r["op"], r["nbytes"]) for r in rows)
    worst = spreads[-1]
    print(
        f"summary: timing spread p75/p25 over {cfg.reps} repetitions: median "
        f"{statistics.median(s[0] for s in spreads):.2f}, max {worst[0]:.2f} "
        f"({worst[1]} at {_mib(worst[2])})",
        flush=True,
    )
    if model:
        errs = ", ".join(f"{a} {max(e):.0%}" for a, e in model["errors"].items())
        med = {a: statistics.median(e) for a, e in model["errors"].items()}
        print(
            f"summary: cost model alpha = {model['alpha'] * 1e6:.1f} us, beta = "
            f"{model['beta'] / 1e9:.3f} GB/s; max |error| from {_mib(cfg.fit_min_bytes)} on "
            f"{n} ranks: {errs or 'no sizes'} (median "
            + ", ".join(f"{a} {m:.0%}" for a, m in med.items())
            + ")",
            flush=True,
        )
    elif n == 1 and any(r["op"] in MODEL_ALGOS for r in rows):
        print("summary: cost model not fitted: 1 rank sends nothing (needs >= 2 ranks)", flush=True)
    print(f"wrote {cfg.out_dir}/bench.csv, busbw.png", flush=True)
