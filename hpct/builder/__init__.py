"""``hpct-build``: fetch the pinned sources, apply hpct's patch series, build."""
