"""Segment storage behind one interface (``base.SegmentStore``); the fps store is the primary one."""
