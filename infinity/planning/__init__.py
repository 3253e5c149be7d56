"""The planner: predictions of a configuration's bytes, time and memory from a recorded step."""
