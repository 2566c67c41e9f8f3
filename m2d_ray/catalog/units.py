"""The kinds of unit a stage starts, each paying a fixed start-up before its work: their names are the keys of
`plan.gpu_start_s` and of measured_gpu.json's `start_s`, and `plan.<unit>_s` is each one's start on CPUs."""

from __future__ import annotations

#: a Ray Data actor of the calibration, targets or analysis pass: its process, the teacher loaded, the pass planned
ACTOR = "actor"
#: a stage-1 trial: its student built from its plan
TRIAL = "trial"
#: a stage-2 student: its Train worker group started, its initial student built, its export
STUDENT = "student"
#: a stage-3 model: loaded and lm-eval's set-up
MODEL = "model"
UNITS = (ACTOR, TRIAL, STUDENT, MODEL)
