// The model shapes of tests/planner/data/configs (real models' config.json shape fields), for
// the planner's tests.
#ifndef LATHE_TESTS_PLANNER_CONFIG_SHAPES_H_
#define LATHE_TESTS_PLANNER_CONFIG_SHAPES_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/file_util.h"
#include "common/model_config.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "planner/model_shape.h"
#include "tests/testing/source_path.h"

namespace lathe::testing {

// The shape of tests/planner/data/configs/<name>.json, or its read or parse error.
inline absl::StatusOr<ModelShape> ShapeOf(const std::string& name) {
  const std::string path = SourcePath("tests/planner/data/configs/" + name + ".json");
  LATHE_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  LATHE_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, path));
  return ModelShapeOf(config);
}

// The same for a config the test needs: a failure fails the test (an empty shape then).
inline ModelShape Shape(const std::string& name) {
  absl::StatusOr<ModelShape> shape = ShapeOf(name);
  EXPECT_TRUE(shape.ok()) << shape.status();
  return shape.ok() ? *shape : ModelShape();
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_PLANNER_CONFIG_SHAPES_H_
