// `lathe`: the command-line client of a Lathe coordinator (see client/cli.h).
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "client/cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return lathe::RunCli(args, std::cout, std::cerr, isatty(STDOUT_FILENO) == 1);
}
