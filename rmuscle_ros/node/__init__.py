"""ROS 2 transport: the lifecycle node and the message conversions it uses."""
