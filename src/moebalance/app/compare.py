"""Compare plans on one load: each scenario plans on the first batches and is scored on the held-out rest
(CRAFT Section 5.1's protocol).

A :class:`Scenario` is one row of a comparison: a name, a label, a policy with its parameters, a budget and a
router. A :class:`Comparison` is a load, a cluster and its scenarios; ``moebalance compare`` builds one from its
arguments, and the demo is a list of them (:mod:`moebalance.app.demo`). Rows are keyed by scenario name; the
label is what tables show.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from moebalance.app.console import err, out, progress, write_files
from moebalance.app.options import bytes_per_copy
from moebalance.app.report import ComparisonRow, comparison_markdown, comparison_table, plot_per_layer
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.io import atomic_write_text, dumps
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement, write_plan
from moebalance.policies import make_plan
from moebalance.pricing.goodput import PlanPrice
from moebalance.pricing.phase import PhaseModel, PhaseTime
from moebalance.routing import Router
from moebalance.routing.simulate import evaluate

__all__ = ["COMPARISON_FILES", "Comparison", "PhaseRow", "Scenario", "comparison_title", "emit_comparison",
           "phase_lines", "run_comparison", "run_scenarios"]


@dataclass(frozen=True, slots=True)
class Scenario:
    """One row: ``policy`` with ``params`` under ``budget``, scored with ``router``.

    ``name`` keys the row among the comparison's rows (default: the label); ``label`` is what tables show
    (default: the policy); ``plan_name`` names the plan file ``plan-<name>.json`` (default: the label);
    ``shown=False`` keeps the row out of the table, for numbers a note quotes.
    """

    policy: str
    budget: Budget
    params: Mapping[str, Any] = field(default_factory=dict)
    #: A router name or a :class:`~moebalance.routing.Router` (with its options).
    router: str | Router = "uniform"
    label: str | None = None
    plan_name: str | None = None
    shown: bool = True
    #: A plan made elsewhere (``compare --baseline``: what an engine runs today), scored as it is: no planning.
    fixed: Placement | None = None
    #: Seconds it took to make ``fixed``, if it was made for this comparison (``--auto-by goodput``).
    fixed_seconds: float = 0.0
    name: str | None = None

    @property
    def display(self) -> str:
        """The row's label in tables."""
        return self.label or self.policy

    @property
    def key(self) -> str:
        """The row's key among the comparison's rows."""
        return self.name or self.display


@dataclass(frozen=True, slots=True)
class PhaseRow(ComparisonRow):
    """A row scored on a phase's steps (``compare --phase``), with its modelled MoE layer time."""

    phase: PhaseTime | None = None

    def as_dict(self) -> dict[str, Any]:
        d = ComparisonRow.as_dict(self)
        if self.phase is not None:
            d["phase"] = self.phase.as_dict()
        return d


@dataclass(frozen=True, slots=True)
class Comparison:
    """Scenarios on one load and cluster, planned on ``train_frac`` of the batches."""

    load: str
    cluster: Cluster
    scenarios: tuple[Scenario, ...]
    train_frac: float = 0.5
    seed: int = 0
    #: Notes printed under the table; each may quote rows by scenario name (``rows[name].score.balancedness``).
    notes: Callable[[Mapping[str, ComparisonRow]], list[str]] = lambda rows: []


def run_comparison(load: LoadMatrix, cluster: Cluster, scenarios: Sequence[Scenario], *, train_frac: float = 0.5,
                   seed: int = 0, bytes_per_copy: int | None = None,
                   on_done: Callable[[str], None] | None = None,
                   price: Callable[[Placement, LoadMatrix, str | Router], PlanPrice] | None = None,
                   kernel: str = "per-gpu",
                   phase: PhaseModel | None = None,
                   on_scored: Callable[[float], None] | None = None,
                   ) -> tuple[dict[str, ComparisonRow], dict[str, Placement]]:
    """Plan and score every scenario; rows by scenario key (in order) and plans by plan name.

    Scenarios that differ only in their router share one plan (made once, its planning time on each row). With
    ``price``, each row also carries ``price(plan, held-out load, router)`` (``compare --gpu``). With ``phase``
    (``compare --phase``) each plan is scored on the held-out batches drawn as that phase's steps for its
    deployment (:mod:`moebalance.pricing.phase`), and each row is a :class:`PhaseRow` with its modelled MoE layer time.
    ``on_done`` is called with each scenario's key once its row is made; ``on_scored``, on a token-level load, with
    the share of a scenario's scored batches just replayed (a chunk of them; a progress bar's advance).
    """
    keys = [sc.key for sc in scenarios]
    for k in keys:
        if keys.count(k) > 1:
            raise InputError(f"two rows of the comparison are named {k!r}; give each scenario its own name")
    train, test = load.split(train_frac)
    rows: dict[str, ComparisonRow] = {}
    plans: dict[str, Placement] = {}
    made: dict[str, tuple[Placement, float]] = {}
    for sc in scenarios:
        if sc.fixed is not None:
            plan, seconds = sc.fixed, sc.fixed_seconds
        else:
            key = repr((sc.policy, sorted(sc.params.items()), sc.budget))
            if key not in made:
                made[key] = make_plan(sc.policy, train, cluster, sc.budget, **dict(sc.params))
            plan, seconds = made[key]
        scored, tokens = (test, 0) if phase is None else phase.plan_steps(plan, test)

        def replayed(n: int, of: int = scored.num_batches) -> None:
            if on_scored is not None:
                on_scored(n / of)

        score = evaluate(plan, scored, sc.router, seed=seed, bytes_per_copy=bytes_per_copy, routing_gap=True,
                         kernel=kernel, on_batches=replayed)
        modelled = None if price is None else price(plan, scored, sc.router)
        note = plan.params.get("budget_note")
        timed = None if phase is None else phase.time(plan, scored, sc.router, tokens)
        rows[sc.key] = PhaseRow(sc.display, score, seconds, plan.warnings, modelled,
                                note if isinstance(note, str) else None, timed)
        if sc.shown:
            plans[sc.plan_name or sc.display] = plan
        if on_done is not None:
            on_done(sc.key)
    return rows, plans


def run_scenarios(load: LoadMatrix, cluster: Cluster, scenarios: Sequence[Scenario], train_frac: float, seed: int,
                  price: Callable[[Placement, LoadMatrix, str | Router], PlanPrice] | None = None,
                  kernel: str = "per-gpu",
                  phase: PhaseModel | None = None) -> tuple[dict[str, ComparisonRow], dict[str, Placement]]:
    """:func:`run_comparison` with a progress bar, copies of the load model's hidden size."""
    with progress() as bar:
        task = bar.add_task("plan + score", total=len(scenarios))
        finished = iter(range(1, len(scenarios) + 1))  # a scenario ends on a whole step, whatever its chunks added
        return run_comparison(load, cluster, scenarios, train_frac=train_frac, seed=seed,
                              bytes_per_copy=bytes_per_copy(load, None, 2),
                              on_done=lambda _: bar.update(task, completed=next(finished)),
                              price=price, kernel=kernel, phase=phase, on_scored=lambda share: bar.advance(task, share))


def comparison_title(load: LoadMatrix, source: str, cluster: Cluster, budget: Budget, train_frac: float,
                     router: str) -> str:
    train, test = load.split(train_frac)
    return (f"{load.preset or source}: {load.num_layers} layers x {load.num_experts} experts on "
            f"{cluster.num_nodes}x{cluster.gpus_per_node} GPUs, {budget.describe()}, planned on {train.num_batches} "
            f"batches, scored on {test.num_batches}{' held-out' if train_frac < 1 else ''} ({router} router)")


def phase_lines(rows: Sequence[ComparisonRow]) -> list[str]:
    """A Markdown table of the rows' modelled MoE layer time on a phase's steps (none without ``--phase``)."""
    timed = [(r.policy, r.phase) for r in rows if isinstance(r, PhaseRow) and r.phase is not None]
    if not timed:
        return []
    first = timed[0][1]
    out = ["", f"Modelled MoE layer time on {first.steps} {first.phase} steps (the slowest GPU's grouped GEMM over "
               "its picks and the experts they touch, plus the all-to-all; mean over steps and layers with load):", "",
           "| row | tokens per step | expert | all-to-all | MoE layer |", "|---|---|---|---|---|"]
    out += [f"| {label} | {t.step_tokens:,} | {1e3 * t.expert_ms:.1f} us | {1e3 * t.a2a_ms:.1f} us | "
            f"{1e3 * t.moe_layer_ms:.1f} us |" for label, t in timed]
    priced = [r for r in rows if isinstance(r, PhaseRow) and r.phase is not None and r.price is not None]
    fast = min(priced, key=lambda r: r.phase.moe_layer_ms, default=None)  # type: ignore[union-attr]
    best = max(priced, key=lambda r: r.price.modelled_goodput, default=None)  # type: ignore[union-attr]
    if fast is not None and best is not None and fast is not best:
        out += ["", f"{fast.policy} has the shortest MoE layer on these {first.phase} steps but {best.policy} the most "
                    "modelled goodput: goodput prices each plan on the held-out batches as recorded (decode and "
                    "prefill rounds at the KV cache's concurrency), a different workload from these steps, so the "
                    "two can rank rows differently; the step that matters is the one your engine serves."]
    return out


def emit_comparison(rows: list[ComparisonRow], plans: dict[str, Placement], title: str, out_dir: str | None,
                    as_json: bool, notes: Sequence[str] = (),
                    more: Sequence[tuple[str, Callable[[], object]]] = ()) -> None:
    """Print the comparison (table or JSON), its warnings and budget notes; with ``out_dir`` write the Markdown,
    JSON, per-layer plot and plans there, then the ``more`` files (``(name, write)`` pairs: the report), each a step
    on the terminal's bar (:func:`~moebalance.app.console.write_files`), before anything is printed (the caller says
    what it wrote once its folder is in place: :func:`moebalance.core.io.atomic_dir`). Rows timed on a phase's steps
    (:class:`PhaseRow`) add a table of their modelled MoE layer time."""
    doc = {"title": title, "rows": [r.as_dict() for r in rows]}
    notes = [*phase_lines(rows), *notes]
    warned: set[str] = set()
    for r in rows:  # rows of one plan under several routers share its warnings: each is printed once
        for w in r.warnings:
            if w not in warned:
                warned.add(w)
                err.print(f"warning: {r.policy}: {w}")
    if out_dir:
        d = Path(out_dir)
        markdown = [*notes, "", "![per-layer balancedness](per_layer_balancedness.png)"]
        write_files([
            ("comparison.md", lambda: atomic_write_text(d / "comparison.md",
                                                         comparison_markdown(rows, title, markdown))),
            ("comparison.json", lambda: atomic_write_text(d / "comparison.json", dumps(doc))),
            ("per_layer_balancedness.png", lambda: plot_per_layer(rows, d / "per_layer_balancedness.png", title)),
            *[(f"plan-{name}.json", partial(write_plan, d / f"plan-{name}.json", plan))
              for name, plan in plans.items()],
            *more])
    if as_json:
        sys.stdout.write(dumps(doc))
        return
    out.print(comparison_table(rows, title))
    for note in notes:
        out.print(note)


#: What ``compare --out-dir`` and each folder of ``demo --out-dir`` hold.
COMPARISON_FILES = "comparison.md, comparison.json, per_layer_balancedness.png, plan-*.json and report.html"
