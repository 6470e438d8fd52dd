"""`ppoflow explore`: a run's rollouts in the browser (command.py, server.py, static/)."""
