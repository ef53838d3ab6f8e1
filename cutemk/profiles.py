"""Reading the profile of a compiled graph's last launch (``CuteGraph(..., profile=...)``):
the per-task records and their phases, the per-CTA records, the ring slices, a Chrome trace.
A mixin of :class:`cutemk.runtime.CuteGraph` (``spec``, ``last_env``, ``num_sms``,
``graph``, ``_bufs``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .codegen.layout import CTA_SLICES, PROF_END, PROF_SM_NODE, PROF_WIDTH
from .codegen.profiling import record_words, slice_records
from .trace import task_record


class ProfileReaders:
    """The profile readers of :class:`cutemk.runtime.CuteGraph`."""

    def profile_records(self) -> list[dict[str, Any]]:
        """Per task of the last launch that ran (``%globaltimer`` ns): its SM, when its
        consumers took it (``start_ns``) and when it was published (``end_ns``), its label and
        node, and its phases (``cutemk.trace.PHASES``; None where not recorded): when the
        producer took it up (``fetched_ns``), had armed its early loads (``armed_ns``), found
        its events met (``ready_ns``), when its consumers found a ring tile's first slice
        landed (``landed_ns``) and staged its output for the storer (``staged_ns``)."""
        if not self.spec.profile or self.last_env is None:
            raise ValueError("compile with profile=True and run once before reading a profile")
        b = self._bufs(self.last_env)
        raw = self._profile_rows(b)[: b.plan.num_tasks]
        return [task_record(r, b.plan.tasks[t]) for t, r in enumerate(raw) if r[PROF_END] > 0]

    def _profile_rows(self, b: Any) -> np.ndarray:
        """The task and CTA records of the last launch (not the slice regions), one a row."""
        words = record_words(b.plan.num_tasks, self.num_sms)
        return b.torch_dev["prof"][:words].cpu().numpy().reshape(-1, PROF_WIDTH)

    def profile_slices(self) -> list[dict[str, Any]]:
        """Per ring task of the last launch of a graph compiled with ``profile="slices"``:
        its label, node and SM, and its slices in order as ``(issued_ns, landed_ns)`` (the
        producer armed the slot and issued the loads it may issue before the task's events,
        the consumers found it landed; 0 where not stamped), and each slice's ``phases`` word
        (``cutemk.codegen.profiling.unpack_phases``; 0 where the op stamps none).
        ``cutemk.trace.slice_summary`` reads them. Warns where a CTA issued more slices than its
        region holds (the dynamic scheduler's regions hold twice a CTA's share): those were not
        stamped."""
        if not self.spec.profile_slices or self.last_env is None:
            raise ValueError(
                "compile with profile='slices' and run once before reading slice stamps"
            )
        b = self._bufs(self.last_env)
        raw = b.torch_dev["prof"].cpu().numpy()
        tasks = b.plan.tasks
        rows = self._profile_rows(b)
        sm = rows[: b.plan.num_tasks, PROF_SM_NODE] & 0xFFFFFFFF
        ctas = rows[b.plan.num_tasks : b.plan.num_tasks + self.num_sms]
        per_cta = slice_records(raw, self.num_sms, b.plan.num_tasks)
        dropped = sum(max(int(c[CTA_SLICES]) - len(s), 0) for c, s in zip(ctas, per_cta))
        if dropped:
            warnings.warn(
                f"{dropped} ring slices past the profile's slice regions were not stamped",
                stacklevel=2,
            )
        by_task: dict[int, dict[str, Any]] = {}
        for cta in per_cta:
            for _, t, issued, landed, phases in cta:
                if not 0 <= t < b.plan.num_tasks:
                    continue
                rec = by_task.setdefault(
                    t,
                    {
                        "label": tasks[t].label,
                        "node": tasks[t].node.name,
                        "sm": int(sm[t]),
                        "slices": [],
                        "phases": [],
                    },
                )
                rec["slices"].append((issued, landed))
                rec["phases"].append(phases)
        return [by_task[t] for t in sorted(by_task)]

    def profile_ctas(self) -> list[dict[str, Any]]:
        """Per CTA of the last launch (``%globaltimer`` ns): its SM, when it entered the plan,
        when its roles were done (its last task's store drained) and when it left (the last
        CTA out also closes the launch): what a launch spends outside its tasks; and the ring
        slices its producer issued (``slices``)."""
        if not self.spec.profile or self.last_env is None:
            raise ValueError("compile with profile=True and run once before reading a profile")
        b = self._bufs(self.last_env)
        n = b.plan.num_tasks
        raw = self._profile_rows(b)[n : n + self.num_sms]
        keys = ("sm", "entry_ns", "roles_done_ns", "exit_ns", "slices")
        return [dict(zip(keys, map(int, r))) for r in raw if r[3] > 0]

    def export_trace(self, path: str | Path) -> Path:
        """Chrome-trace JSON of the last launch (one track per SM); opens in Perfetto."""
        from .trace import chrome_trace

        path = Path(path)
        path.write_text(json.dumps(chrome_trace(self.profile_records(), self.graph.name)))
        return path
