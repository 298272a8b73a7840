"""What the compiler's passes, planner and kernels exchange: formats, sites, plans, epilogues."""
