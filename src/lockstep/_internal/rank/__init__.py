"""The worker side: the worker process and runtime, its session (report(), checkpoints, uploads),
its environment, devices and step timing.
"""
