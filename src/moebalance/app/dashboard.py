"""``watch --dashboard PORT``: one page, served on localhost, that loads itself again every few seconds: the balance of
the placement in service per MoE layer over the records, tokens/s now and after the best re-plan, the decisions
and the hottest experts (the look of ``report.html``: :class:`moebalance.app.html_report.Report`)."""

from __future__ import annotations

import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from moebalance.app.html_report import Report
from moebalance.core.errors import InputError
from moebalance.online.watch import Observation

__all__ = ["Dashboard", "page"]

#: Records the page shows (the newest).
SHOWN = 120


def page(observations: list[Observation], title: str, subtitle: str, refresh_s: int) -> str:
    """The page for ``observations`` (oldest first)."""
    report = Report(title, subtitle, refresh_s=refresh_s)
    if not observations:
        return report.note("No record yet: watch is waiting for the engine's first one.").html()
    last = observations[-1]
    decided = [o for o in observations if o.decision == "replan"]
    report.recommendation(f"{last.record}: {last.decision} ({last.reason})" + (
        f"; {len(decided)} re-plan(s) among the {len(observations)} records shown" if decided else ""),
        name="Latest decision")
    bal = np.stack([o.balancedness for o in observations], axis=1)  # [L, records]
    report.heatmap("Balancedness per MoE layer", bal, labels=("records, oldest to newest", ""),
                   scale_label="balancedness (mean over max GPU load; 1 is perfect)", xlabel="record",
                   caption="Grey: a layer without load in the window.")
    priced = [o for o in observations if o.tokens_per_s_now is not None]
    if priced:
        report.lines("Tokens per second", {
            "now": [float(o.tokens_per_s_now or 0.0) for o in observations],
            "after the best re-plan": [float(o.tokens_per_s_replan or 0.0) for o in observations]},
            "tokens/s (modelled)", xlabel="record")
    report.lines("Drift and balance", {
        "balancedness, mean over layers": [float(np.nanmean(o.balancedness)) if np.isfinite(o.balancedness).any()
                                           else float("nan") for o in observations],
        "drift from the planning routing": [o.drift for o in observations]}, "ratio", xlabel="record",
        ylim=(0.0, 1.0))
    rows = [[o.record, o.decision, "" if o.gain_tokens is None else f"{o.gain_tokens:,.0f}",
             "" if o.moved_gib is None else f"{o.moved_gib:.1f}", o.reason] for o in reversed(observations[-12:])]
    report.ranking(rows, ["record", "decision", "tokens gained over the horizon", "GiB moved", "why"],
                   name="Decisions, newest first", best=None)
    report.ranking([[layer, expert, f"{share:.1%}"] for layer, expert, share in last.hottest],
                   ["MoE layer", "expert", "share of the layer's picks"], name="Hottest experts", best=None)
    return report.html()


class Dashboard:
    """The page's server: a thread answering ``GET /`` with the page of the observations given so far."""

    def __init__(self, port: int, host: str, title: str, subtitle: str, refresh_s: int) -> None:
        self._lock = threading.Lock()
        self._observations: deque[Observation] = deque(maxlen=SHOWN)
        self._html = page([], title, subtitle, refresh_s).encode()
        self._args = (title, subtitle, refresh_s)
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path not in ("/", "/index.html"):
                    self.send_error(404)
                    return
                with dashboard._lock:
                    body = dashboard._html
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return  # no access log on the terminal

        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise InputError(f"--dashboard {port} on {host}: {exc.strerror}; give a free port") from None
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, observation: Observation) -> None:
        with self._lock:
            self._observations.append(observation)
            items = list(self._observations)
        html = page(items, *self._args).encode()
        with self._lock:
            self._html = html

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
