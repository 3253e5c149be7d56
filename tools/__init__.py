"""The repository's benchmarks and development scripts (not packaged): ``tools.benchmarks`` on
top, ``tools.common`` (what they share) below, both over the library's ``infinity.cli``."""
