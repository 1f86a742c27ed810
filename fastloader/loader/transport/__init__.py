"""Batches from worker processes to the main process through reusable shared-memory slots.

NOTE [ Batch transport ] (to be written in full)
"""
