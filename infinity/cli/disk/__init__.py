"""The parts of infinity-bench: the engine sweep, fio and aiofiles baselines, the interference
probe, recommendations, the report and plots."""
