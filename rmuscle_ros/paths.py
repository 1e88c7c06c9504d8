"""Files the package ships beside its Python code (config/, msg/): at the repository's root in a source
checkout (the README's venv, CI), under the package's share directory once installed by `colcon build`
(CMakeLists.txt installs config/ there, rosidl the .msg files into msg/). Found in review: the paths were
taken from the source layout only, so after a colcon build the bag tools found no message definitions and
the demo no profiles."""

from __future__ import annotations

from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]


def source_checkout() -> bool:
    """Whether this package runs from its repository (package.xml beside the Python package)."""
    return (SOURCE_ROOT / "package.xml").is_file()


def package_file(*parts: str) -> Path:
    """`parts` under the repository's root in a source checkout, else under the package's share directory
    (found through the ament index of the sourced workspace). FileNotFoundError saying which when
    neither can be found; the caller reports a missing file itself."""
    if source_checkout():
        return SOURCE_ROOT.joinpath(*parts)
    try:
        from ament_index_python.packages import get_package_share_directory

        return Path(get_package_share_directory("rmuscle_ros")).joinpath(*parts)
    except (ImportError, LookupError) as e:  # PackageNotFoundError is a KeyError
        raise FileNotFoundError(
            f"rmuscle_ros's {'/'.join(parts)}: not a source checkout ({SOURCE_ROOT} has no package.xml) and "
            f"the package's share directory is not found ({type(e).__name__}: {e}); source the workspace's "
            "install/setup.bash"
        ) from e
