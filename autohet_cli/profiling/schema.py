"""The ``autohet.profile/v1`` artifact, re-exported from ``estimates`` (pure).

The profile's types and their YAML form moved below the cost model
(``estimates.profile``, ``estimates.profile_io``), which reads them; this module
keeps the old imports working.
"""

from __future__ import annotations

from autohet_cli.estimates.profile import RC_FITTED as RC_FITTED
from autohet_cli.estimates.profile import SCHEMA as SCHEMA
from autohet_cli.estimates.profile import SOURCES as SOURCES
from autohet_cli.estimates.profile import DeviceFacts as DeviceFacts
from autohet_cli.estimates.profile import EntryKey as EntryKey
from autohet_cli.estimates.profile import LayerTiming as LayerTiming
from autohet_cli.estimates.profile import Overhead as Overhead
from autohet_cli.estimates.profile import Profile as Profile
from autohet_cli.estimates.profile import ProfileEntry as ProfileEntry
from autohet_cli.estimates.profile import rc_mark as rc_mark
from autohet_cli.estimates.profile_io import load_profile as load_profile
from autohet_cli.estimates.profile_io import profile_from_dict as profile_from_dict
from autohet_cli.estimates.profile_io import profile_to_dict as profile_to_dict
from autohet_cli.estimates.profile_io import save_profile as save_profile
