"""Simulated cells for closed-loop tests and demos: a MuJoCo ALOHA (aloha.py). No ROS here."""
