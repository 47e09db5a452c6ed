"""The single controller: Ray placement, worker groups, the policy rank and the fit loop."""
