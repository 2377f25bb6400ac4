"""The outer-step driver: when rounds start and land, per-optimizer slots, overlap, fragments, pacing, plug-ins
and reports. No Lightning."""
