"""How the job's processes are hosted: the one executor its tasks run through (Ray tasks, a warm runtime's task hosts,
or this process), the Ray session it starts or joins, the one launcher that runs a job as a child process (the night
window's shifts, the Batch API server) with the environment it hands it, and the warm runtime (`nightshift up`)."""
