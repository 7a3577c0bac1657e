"""The control plane: the seam to Ray and Serve (cluster.py), the registry that owns every record
and reservation, the admin API and its reconciler, the planner's Serve shell."""
