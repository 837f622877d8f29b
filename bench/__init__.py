"""Conveyor's benchmarks (``conveyor bench KIND``): they print figures and never assert on time.

One subpackage per thing measured: ``engine`` (the engine in process: scheduling modes,
structured outputs), ``serve`` (an HTTP load generator, and the scheduling modes over HTTP),
``peers`` (Conveyor against vLLM for CPU), ``gateway`` (routing policies, the gateway's
overhead), ``autoscale`` (a step load against the autoscaler), ``gpu`` (kernels, decode
bandwidth utilisation). They share one process owner (``procs``), one wait helper
(``wait``) and one percentile function (``stats``). Nothing here is imported at package
import time, so the engine benchmark runs where only torch is installed.
"""
