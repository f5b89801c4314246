"""The negative strategies of the papers, one module each: ANCE (:mod:`.ance`), SimANS
(:mod:`.simans`), ANCE-Tele (:mod:`.tele`), DANCE (:mod:`.dance`) and the DPR-style
baselines BM25 (:mod:`.bm25`), random (:mod:`.random`), BM25 + random
(:mod:`.bm25_random`) and in-batch (:mod:`.in_batch`).

:mod:`.base` defines what a strategy is; :mod:`.registry` maps configuration names to
strategies, each registered by an entry point (pyproject.toml). See docs/strategies.md.
"""
