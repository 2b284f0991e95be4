"""The alpha-beta model of the hand-written all-reduces, fitted to this machine's measurements.

    t = steps * alpha + B / beta     (nccl-tests doc/PERFORMANCE.md; Thakur, Rabenseifner & Gropp
                                      2005, "Optimization of collective communication operations")

alpha: seconds per round; beta: bytes/s. steps and B come from the schedule in algorithms.py.
B = sum over rounds of the bytes on the round's bottleneck, in one of two views:
  links (GPUs, NCCL's view): each rank has its own full-duplex link: B = busiest sender's bytes.
      ring  2(n-1) rounds of ceil(N/n) elements:  B = 2(n-1) ceil(N/n) e  ~ 2(n-1)/n S
      tree  k + 2D - 1 rounds (D = height, k chunks); an inner node sends a chunk up and one to
            each of its 2 children per round:     B ~ 3 S      (n >= 4; 2 S at n = 3, S at n = 2)
      dbt   two trees of S/2, a rank is inner in at most one: B ~ (1 + 2 + 1) S/2 = 2 S
  C CPU cores (this box): every byte costs CPU time to send and again to receive, and the n
      ranks share C cores: B per round = max(busiest rank's sent + received, all ranks' / C).
      ring on n <= C ranks: 2(n-1) rounds of 2 ceil(N/n) e; on n > C: 2 n ceil(N/n) e / C each.
"""

from __future__ import annotations

import math

import numpy as np

from day16_nccl.algorithms import (
    TREE_CHUNK_BYTES,
    binary_tree,
    double_binary_tree,
    tree_rounds,
)

# ------------------------------------------------------------------------------------------
# Exact counts: what each rank sends and how many rounds (checked against Stats in the tests)
# ------------------------------------------------------------------------------------------


def chunk_sizes(numel: int, n: int) -> list[int]:
    """torch.tensor_split sizes: the first numel mod n chunks hold one element more."""
    return [numel // n + (1 if i < numel % n else 0) for i in range(n)]


def ring_counts(numel: int, n: int, elem: int) -> tuple[int, list[int]]:
    """(steps, bytes sent per rank). Rank r sends every chunk but its own in the reduce-scatter and
    every chunk but chunk r+1 in the all-gather: (2N - |c_r| - |c_(r+1)|) * e; = 2(n-1)/n * S when n
    divides N."""
    c = chunk_sizes(numel, n)
    return 2 * (n - 1), [(2 * numel - c[r] - c[(r + 1) % n]) * elem for r in range(n)]


def _segments(algo: str, numel: int, n: int):
    if algo == "tree":
        return [(binary_tree(n), numel)]
    t1, t2 = double_binary_tree(n)
    half = (numel + 1) // 2
    return [(t1, half), (t2, numel - half)]


def tree_counts(
    algo: str, numel: int, n: int, elem: int, chunk_bytes: int = TREE_CHUNK_BYTES
) -> tuple[int, list[int]]:
    """(steps, bytes sent per rank) for "tree" or "dbt": each tree moves its segment once up each
    edge and once down each edge, so rank r sends segment * (1 if it has a parent + #children)."""
    per = chunk_bytes // elem
    steps, sent = 0, [0] * n
    for tree, seg in _segments(algo, numel, n):
        steps = max(steps, tree_rounds(tree, math.ceil(seg / per)))
        for r in range(n):
            sent[r] += seg * elem * ((tree.parent[r] != -1) + len(tree.children[r]))
    return steps, sent


def _round_bytes(tree, r: int, sizes: np.ndarray, rounds: int) -> np.ndarray:
    """Bytes rank r sends plus receives in each round of the tree schedule (tree_round_ops,
    vectorised): row 0 sends (chunk t-(D-d) up, chunk t-D-d down to each child), row 1 receives
    (the same chunks one round later on the other end of each edge)."""
    v, k, D, d = np.zeros((2, rounds)), len(sizes), tree.height, tree.depth[r]
    kids = len(tree.children[r])
    if tree.parent[r] != -1:
        v[0, D - d : D - d + k] += sizes
        v[1, D + d - 1 : D + d - 1 + k] += sizes
    if kids:
        v[0, D + d : D + d + k] += kids * sizes
        v[1, D - d - 1 : D - d - 1 + k] += kids * sizes
    return v


def critical_bytes(
    algo: str,
    numel: int,
    n: int,
    elem: int,
    chunk_bytes: int = TREE_CHUNK_BYTES,
    cores: int | None = None,
) -> tuple[int, int]:
    """(steps, B): B = sum over rounds of the bytes on the busiest resource in that round.

    cores=None, links (GPUs, NCCL's view): every rank has its own full-duplex link, so a round
    lasts as long as its busiest sender: max over ranks of bytes sent.
    cores=C, a CPU box: every byte costs CPU time to send and again to receive, and the n ranks
    share C cores: max(busiest rank's sent + received, all ranks' sent + received / C)."""
    if algo == "ring":
        c = math.ceil(numel / n) * elem  # every rank sends and receives one chunk per round
        per_round = c * ring_factor(n, cores)
        return 2 * (n - 1), int(2 * (n - 1) * per_round)
    per = chunk_bytes // elem
    plans = []
    for tree, seg in _segments(algo, numel, n):
        sizes = np.array([min(per, seg - i) for i in range(0, seg, per)], dtype=float) * elem
        plans.append((tree, sizes))
    steps = max(tree_rounds(tree, len(sizes)) for tree, sizes in plans)
    if not steps:
        return 0, 0
    # ranks with the same (depth, has parent, #children) in every tree move alike: one row each
    kinds: dict[tuple, list[int]] = {}
    for r in range(n):
        sig = tuple((t.depth[r], t.parent[r] != -1, len(t.children[r])) for t, _ in plans)
        kinds.setdefault(sig, []).append(r)
    rows = {
        sig: sum(_round_bytes(t, rs[0], sz, steps) for t, sz in plans) for sig, rs in kinds.items()
    }
    if cores is None:
        return steps, int(np.max([v[0] for v in rows.values()], axis=0).sum())
    busiest = np.max([v.sum(axis=0) for v in rows.values()], axis=0)
    total = sum(len(kinds[sig]) * v.sum(axis=0) for sig, v in rows.items())
    return steps, int(np.maximum(busiest, total / cores).sum())


# ------------------------------------------------------------------------------------------
# The model, its fit, and where tree beats ring
# ------------------------------------------------------------------------------------------


def predict(
    alpha: float,
    beta: float,
    algo: str,
    nbytes: int,
    n: int,
    elem: int = 4,
    chunk_bytes: int = TREE_CHUNK_BYTES,
    cores: int | None = None,
) -> float:
    steps, b = critical_bytes(algo, nbytes // elem, n, elem, chunk_bytes, cores)
    return steps * alpha + b / beta


def fit(
    rows: list[dict], elem: int = 4, chunk_bytes: int = TREE_CHUNK_BYTES, cores: int | None = None
):
    """Least squares for (alpha, 1/beta) on relative error: minimise sum ((model - t) / t)^2.

    rows: dicts with algo, nbytes, n, time_s. Returns (alpha s, beta bytes/s)."""
    a, y = [], []
    for row in rows:
        steps, b = critical_bytes(
            row["algo"], row["nbytes"] // elem, row["n"], elem, chunk_bytes, cores
        )
        a.append([steps / row["time_s"], b / row["time_s"]])
        y.append(1.0)
    a, y = np.array(a), np.array(y)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    # A latency or a time per byte below zero is not physical; noisy points can still fit that
    # best. Then the constrained optimum lies on the boundary: fit the other term alone.
    if alpha < 0:
        alpha, inv_beta = 0.0, a[:, 1] @ y / (a[:, 1] @ a[:, 1])
    elif inv_beta <= 0:
        alpha, inv_beta = a[:, 0] @ y / (a[:, 0] @ a[:, 0]), 0.0
    return float(alpha), (1.0 / float(inv_beta) if inv_beta > 0 else math.inf)


def pipeline_shape(algo: str, nbytes: int, n: int, chunk_bytes: int) -> tuple[int, int]:
    """(k, D): chunks per tree and tree height."""
    (tree, seg), *_ = _segments(algo, nbytes, n)  # counted in bytes here: same k
    return math.ceil(seg / chunk_bytes), tree.height


def segment_bytes(algo: str, nbytes: int, n: int) -> int:
    """Bytes one tree carries: S for tree, S/2 per tree for dbt."""
    return _segments(algo, nbytes, n)[0][1]


def best_chunks(
    alpha: float, beta: float, algo: str, nbytes: int, n: int, cores: int | None = None
) -> int:
    """The pipeline depth k in 1..4096 with the smallest predicted time under this model of the
    real schedule (numeric). It sits below k_star, the textbook closed form, because fill and drain
    rounds carry less than the steady state's m chunks (a leaf sends one chunk, not three): B
    hardly grows with the 2D - 1 extra rounds, so deep pipelines buy less than the formula says.
    In the CPU view the n ranks share C cores: every byte costs the same core time however it is
    chunked, nothing overlaps, and each extra chunk only adds a round's alpha (best k = 1)."""
    ks = sorted({max(1, round(1.25**i)) for i in range(38)})
    return min(ks, key=lambda k: predict_at_k(alpha, beta, algo, nbytes, n, k, cores))


def predict_at_k(
    alpha: float, beta: float, algo: str, nbytes: int, n: int, k: int, cores: int | None = None
) -> float:
    """The model's time with each tree's share cut into k chunks."""
    chunk = max(1, math.ceil(segment_bytes(algo, nbytes, n) / k))
    return predict(alpha, beta, algo, nbytes, n, 1, chunk, cores)


def k_star(alpha: float, beta: float, algo: str, nbytes: int, n: int) -> float:
    """The closed form for the links view: minimise t(k) = (k + 2D - 1)(alpha + m S/(k beta)),
    m S = the busiest sender's bytes per round times k (B ~ m S: 3 S tree, 2 S dbt, n >= 4):
    dt/dk = alpha - (2D - 1) m S/(k^2 beta) = 0  ->  k* = sqrt((2D - 1) m S / (alpha beta)).
    m S is read off critical_bytes in the links view with many chunks (the steady state)."""
    _, d = pipeline_shape(algo, nbytes, n, TREE_CHUNK_BYTES)
    seg = segment_bytes(algo, nbytes, n)
    _, b = critical_bytes(algo, nbytes, n, 1, max(1, seg // 4096))  # k = 4096: fill/drain ~0
    return math.sqrt((2 * d - 1) * b / (alpha * beta)) if alpha > 0 and beta > 0 else math.inf


def ring_factor(n: int, cores: int | None = None) -> float:
    """Bytes per round on the bottleneck, in chunks of S/n: 1 on links; on C shared CPU cores
    max(2, 2n/C) (a chunk is sent and received, and n ranks share C cores): critical_bytes' ring."""
    return 1.0 if cores is None else max(2.0, 2 * n / cores)


def ring_time(alpha: float, beta: float, nbytes: float, n: int, cores: int | None = None) -> float:
    """Closed form: 2(n-1) * (alpha + f S/(n beta)), f = ring_factor(n, cores)."""
    return 2 * (n - 1) * (alpha + ring_factor(n, cores) * nbytes / (n * beta))


def crossover_bytes(
    alpha: float,
    beta: float,
    n: int,
    algo: str = "dbt",
    chunk_bytes: int = TREE_CHUNK_BYTES,
    cores: int | None = None,
) -> int | None:
    """Largest power-of-two size (1 KiB .. 16 GiB) below which `algo` is predicted faster than ring,
    or None if it never is. (For n = 2 the trees cannot win: they take more rounds than ring.)"""
    best = None
    for p in range(10, 35):
        if predict(alpha, beta, algo, 2**p, n, 4, chunk_bytes, cores) < predict(
            alpha, beta, "ring", 2**p, n, 4, chunk_bytes, cores
        ):
            best = 2**p
    return best


def plot(
    rows: list[dict],
    alpha: float,
    beta: float,
    path: str,
    chunk_bytes: int = TREE_CHUNK_BYTES,
    cores: int | None = None,
) -> None:
    """Predicted curves (lines) and measured points (markers), time vs size, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo, color in (("ring", "C0"), ("tree", "C1"), ("dbt", "C2")):
        pts = sorted((r["nbytes"], r["time_s"], r["n"]) for r in rows if r["algo"] == algo)
        if not pts:
            continue
        n = pts[0][2]
        grid = np.geomspace(pts[0][0], pts[-1][0], 60)
        pred = [predict(alpha, beta, algo, int(s), n, 4, chunk_bytes, cores) for s in grid]
        ax.plot(grid, pred, color=color, label=f"{algo} model")
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], "o", color=color, label=f"{algo} measured"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("time per all-reduce (s)")
    ax.set_title(
        f"alpha-beta model ({'links' if cores is None else f'{cores} CPU cores'}): "
        f"alpha = {alpha * 1e6:.0f} us, beta = {beta / 1e9:.2f} GB/s",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
