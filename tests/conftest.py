import os
from hypothesis import settings, HealthCheck

# `make test` sets HYPOTHESIS_PROFILE=ci: fewer examples, no deadline (the CI machine is shared and noisy).
settings.register_profile('ci', max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile('dev', max_examples=100, deadline=None)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'dev'))
