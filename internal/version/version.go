package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Version and Revision are set by the linker (-ldflags -X); see the package
// documentation. Read them through Get, which fills in the fallbacks.
var (
	Version  string
	Revision string
)

// Info is the version of the running binary.
type Info struct {
	// Version is the release version, such as v0.1.0; "(devel)" when
	// nothing recorded one.
	Version string
	// Revision is the VCS commit, with "-dirty" when the tree had changes;
	// "unknown" when nothing recorded one.
	Revision string
	// GoVersion is the toolchain that built the binary.
	GoVersion string
}

// Get returns the version of the running binary: the linker's values when
// set, else those of debug.ReadBuildInfo.
func Get() Info {
	bi, _ := debug.ReadBuildInfo()
	return get(Version, Revision, bi)
}

func get(v, rev string, bi *debug.BuildInfo) Info {
	info := Info{Version: v, Revision: rev, GoVersion: runtime.Version()}
	if bi != nil {
		if bi.GoVersion != "" {
			info.GoVersion = bi.GoVersion
		}
		if info.Version == "" && bi.Main.Version != "" {
			info.Version = bi.Main.Version
		}
		if info.Revision == "" {
			var modified bool
			for _, s := range bi.Settings {
				switch s.Key {
				case "vcs.revision":
					info.Revision = s.Value
				case "vcs.modified":
					modified = s.Value == "true"
				}
			}
			if info.Revision != "" && modified {
				info.Revision += "-dirty"
			}
		}
	}
	if info.Version == "" {
		info.Version = "(devel)"
	}
	if info.Revision == "" {
		info.Revision = "unknown"
	}
	return info
}

// String is the one line that --version prints after the binary's name,
// such as "v0.1.0 (revision 05a1338…, go1.26.0)".
func (i Info) String() string {
	return fmt.Sprintf("%s (revision %s, %s)", i.Version, i.Revision, i.GoVersion)
}

// Line is the --version output of the binary called name, without the
// newline: "broker v0.1.0 (revision 05a1338…, go1.26.0)".
func Line(name string) string { return name + " " + Get().String() }
