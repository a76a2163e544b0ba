"""The application: the command-line tool, comparisons of policies, budget sweeps and reports."""
