import pkgutil

# The generated ROS interfaces (rmuscle_ros.msg and its typesupport extensions) are installed by CMake
# into site-packages/rmuscle_ros, while in a dev venv this package is the editable source tree. Extending
# __path__ with every rmuscle_ros directory on sys.path makes the two one package. In a colcon install
# both already share one directory and this changes nothing.
__path__ = pkgutil.extend_path(__path__, __name__)
