"""DeFT's benchmarks, outside the library: the benchmark trees, peers, timing, reports and
stored results (``benchmarks/results/``). It imports ``deft``; ``deft`` never imports it, except
``deft bench``, which calls into it.

Entry points: ``deft bench plan|attention|e2e|serve|tp`` (add ``--json PATH`` to store the result),
``python -m benchmarks.sweep`` (kernel-config sweeps on a GPU) and ``python -m benchmarks.render``
(stored results as Markdown, and into the docs).
"""
