"""Expert offloading: the slot cache, its policies, routing traces, profiles, the simulator, the planner, the PCIe probe."""
