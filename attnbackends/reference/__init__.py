"""Pure-torch reference backend: runs on any device, and serves as the test oracle's twin."""
