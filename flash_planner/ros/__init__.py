"""rclpy adapters only: node, action server, diagnostics. rclpy is imported lazily."""
