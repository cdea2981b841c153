"""The warm start: a process that imports torch before fit() and forks the local workers."""
