"""Discrete-event simulation driving the real control-plane code on a virtual clock; cost model."""
