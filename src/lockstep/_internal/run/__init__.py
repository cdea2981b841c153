"""The run: the driver, the controller and what it holds while ranks run (report barrier,
checkpoint commits, liveness, stops, preemption, the run record, the slow-rank rule) and the
worker-group interface the executors implement.
"""
