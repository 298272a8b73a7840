"""The planner: weight statistics in, a plan out. The cost model predicts every exact format's
time from calibrated numbers and each implementation's work, and timing settles the shortlist."""
