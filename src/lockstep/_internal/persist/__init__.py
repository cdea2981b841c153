"""Storage: the run folder (record, report history, checkpoints, logs) and the filesystems under
it.
"""
