"""The benchmarks behind the make targets: each prints its figures against baselines measured in the
same run."""
