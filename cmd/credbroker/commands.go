package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/internal/version"
	"github.com/credbroker/credbroker/pkg/brokerclient"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// streams are the command's standard input, output and error.
type streams struct {
	in       io.Reader
	out, err io.Writer
}

// Exit codes.
const (
	exitOK     = 0
	exitFailed = 1
	exitUsage  = 2
)

// usageError is a bad command line.
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

// run runs the command line args and returns the exit code.
func run(ctx context.Context, args []string, s streams) int {
	root := newRootCommand(s, time.Now)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return exitOK
	}
	fmt.Fprintf(s.err, "credbroker: %v\n", err)
	var rpc rpcError
	if errors.As(err, &rpc) {
		return exitFailed
	}
	return exitUsage
}

func newRootCommand(s streams, now func() time.Time) *cobra.Command {
	root := &cobra.Command{
		Use:   "credbroker",
		Short: "Manage the spoke tokens the credbroker broker handed out",
		Long: `credbroker talks to the broker's Grants service over TLS, authenticated by a
hub ServiceAccount token for the broker's audience ("kubectl create token NAME
--audience credbroker"). Everyone may list and revoke their own grants; other
consumers' grants need hub RBAC on multicluster.x-k8s.io clusterprofiles/token
of their ClusterProfile: list to see them, delete to revoke them.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		// --version prints the same line as the version command.
		Version: version.Get().String(),
	}
	root.SetVersionTemplate("{{.Name}} {{.Version}}\n")
	// -v/--v is the verbosity, as on the other binaries and kubectl, so
	// --version has no shorthand.
	var verbosity int
	cmdflags.AddVerbosity(root.PersistentFlags(), &verbosity, cmdflags.QuietVerbosityUsage)
	root.PersistentPreRunE = func(*cobra.Command, []string) error {
		if err := cmdflags.CheckVerbosity(verbosity); err != nil {
			return usageError{err}
		}
		return nil
	}
	root.SetIn(s.in)
	root.SetOut(s.out)
	root.SetErr(s.err)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	grantsCmd := &cobra.Command{
		Use:   "grants",
		Short: "List and revoke grants: the spoke tokens the broker handed out",
		Args:  noArgs,
	}
	grantsCmd.AddCommand(newListCommand(s, now), newRevokeCommand(s))
	versionCmd := &cobra.Command{
		Use:   "version",
		Short: "Print the version of credbroker",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := fmt.Fprintln(cmd.OutOrStdout(), version.Line("credbroker"))
			return err
		},
	}
	root.AddCommand(grantsCmd, newKubeconfigCommand(s), versionCmd)
	return root
}

// noArgs refuses positional arguments as a usage error.
func noArgs(_ *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("unexpected arguments %q", args)}
	}
	return nil
}

func newListCommand(s streams, now func() time.Time) *cobra.Command {
	o := &listOptions{}
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the live grants you may see",
		Example: `  credbroker grants list --broker credbroker.example:8443 --ca-file ca.pem --token-file token
  kubectl create token ops --audience credbroker | credbroker grants list --broker … --ca-file ca.pem --token-file - --cluster fleet/prod-eu-1 -o json`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := o.config()
			if err != nil {
				return usageError{err}
			}
			var resp *pb.ListGrantsResponse
			err = call(cmd.Context(), cfg.Conn, s.in, func(ctx context.Context, conn grpc.ClientConnInterface, opt grpc.CallOption) (err error) {
				resp, err = pb.NewGrantsClient(conn).List(ctx, &pb.ListGrantsRequest{Selector: cfg.Selector}, opt)
				return err
			})
			if err != nil {
				return err
			}
			return printList(s.out, s.err, cfg.Output, resp, now())
		},
	}
	o.conn.addFlags(cmd.Flags())
	o.sel.addFlags(cmd.Flags())
	cmd.Flags().StringVarP(&o.output, "output", "o", outputTable, "output format: table or json")
	return cmd
}

func newRevokeCommand(s streams) *cobra.Command {
	o := &revokeOptions{}
	cmd := &cobra.Command{
		Use:   "revoke (--credential-id JTI=…|--user USER|--cluster NAMESPACE/NAME)",
		Short: "Revoke grants: their spoke tokens stop working about 10 s later",
		Long: `Revoke deletes the matching grants on their spokes, whose API servers then refuse
their tokens. It revokes nothing if any matching grant is another consumer's
and you lack delete on clusterprofiles/token of its ClusterProfile. Grants whose
agent is not connected stay pending: the broker revokes them when it reconnects.`,
		Example: `  credbroker grants revoke --broker credbroker.example:8443 --ca-file ca.pem --token-file token --credential-id JTI=0b6c… --reason "leaked in CI log"`,
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := o.config()
			if err != nil {
				return usageError{err}
			}
			var resp *pb.RevokeGrantsResponse
			err = call(cmd.Context(), cfg.Conn, s.in, func(ctx context.Context, conn grpc.ClientConnInterface, opt grpc.CallOption) (err error) {
				resp, err = pb.NewGrantsClient(conn).Revoke(ctx, &pb.RevokeGrantsRequest{Selector: cfg.Selector, Reason: cfg.Reason}, opt)
				return err
			})
			if err != nil {
				return err
			}
			return printRevoke(s.out, cfg.Output, resp)
		},
	}
	o.conn.addFlags(cmd.Flags())
	o.sel.addFlags(cmd.Flags())
	cmd.Flags().StringVar(&o.reason, "reason", "", "why, for the broker's audit log and the agent's log (at most 256 bytes)")
	cmd.Flags().StringVarP(&o.output, "output", "o", outputTable, "output format: table or json")
	return cmd
}

// rpcError is a call the broker refused or that failed.
type rpcError struct{ error }

func (e rpcError) Unwrap() error { return e.error }

// call reads the hub token, connects to the broker and runs fn with the
// token as per-call credentials, within the timeout.
func call(ctx context.Context, cfg connConfig, stdin io.Reader,
	fn func(context.Context, grpc.ClientConnInterface, grpc.CallOption) error) error {
	hubToken, err := readToken(cfg.TokenFile, stdin)
	if err != nil {
		return usageError{fmt.Errorf("--token-file: %w", err)}
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	conn, err := brokerclient.Dial(cfg.Broker, credentials.NewTLS(cfg.TLS), "credbroker")
	if err != nil {
		return rpcError{err}
	}
	defer func() { _ = conn.Close() }()
	if err := fn(ctx, conn, grpc.PerRPCCredentials(brokerclient.Bearer(hubToken))); err != nil {
		st := status.Convert(err)
		// The broker never echoes a token; this is belt and braces.
		msg := strings.ReplaceAll(st.Message(), hubToken, "[redacted]")
		return rpcError{fmt.Errorf("broker %s: %s", cfg.Broker, brokerclient.ExplainStatus(st.Code(), msg))}
	}
	return nil
}

func readToken(name string, stdin io.Reader) (string, error) {
	if name == stdinName {
		return brokerclient.ReadTokenFrom(stdin, "standard input")
	}
	return brokerclient.ReadToken(name)
}
