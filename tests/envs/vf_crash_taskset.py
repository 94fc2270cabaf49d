"""The calculator taskset (tests/envs/vf_calc_taskset.py) whose env server dies mid-run, once: with
`PRIMEJAX_TEST_CRASH_MARKER` set to a path that does not exist yet, the first episode scored creates that file
and SIGKILLs its own process, the env server that scores it (verifiers' `EnvServer` scores in process). Every
later episode, on any server, scores normally. So a run loses exactly one rollout to a killed server, at a
point no test has to time."""

from __future__ import annotations

import os
import signal

import verifiers.v1 as vf

from tests.envs.vf_calc_taskset import CalcTask, CalcTaskset, CalcTasksetConfig

MARKER_VAR = "PRIMEJAX_TEST_CRASH_MARKER"


class CrashTask(CalcTask):
    @vf.metric
    async def server_survived(self, trace) -> float:
        marker = os.environ.get(MARKER_VAR, "")
        if marker:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return 1.0  # the one crash already happened
            os.kill(os.getpid(), signal.SIGKILL)
        return 1.0


class CrashTaskset(vf.Taskset[CrashTask, CalcTasksetConfig]):
    def load(self):
        for task in CalcTaskset.load(self):
            yield CrashTask(task.data, task.config)


__all__ = ["CrashTaskset"]
