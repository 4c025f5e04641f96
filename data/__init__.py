"""Data files shipped with Nightjar, installed as the ``nightjar_data`` package.

The layout is the one every ``--data DIR`` option reads (``calibration/``, ``traces/``,
``prompts/``); sources, commits and licences are in this folder's README.md and in the
repository's NOTICE.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
CALIBRATION = ROOT / "calibration"
AZURE_CONV_TRACE = ROOT / "traces" / "azure_llm_2023_conv.csv"
SPEC_BENCH_PROMPTS = ROOT / "prompts" / "specbench_question.jsonl"
