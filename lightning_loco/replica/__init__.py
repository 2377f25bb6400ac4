"""One replica, without Lightning: options and their rules, run mode, layout and sharding, process groups,
the run of rounds, checkpoints, consensus."""
