"""Benchmark rope_pool_fused; see docs/benchmarks.md. Same as `ropepool bench`."""
import sys

from ropepool.cli.bench import main

sys.exit(main())
