"""Starting the job: the run folder, torch elastic on one or several nodes, each rank."""
