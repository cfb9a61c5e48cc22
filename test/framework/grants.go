package framework

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	spokepkg "github.com/credbroker/credbroker/pkg/spoke"
)

// ClaimedGrants lists the grant Secrets in namespace ns of c that name a
// hub user: the grants of minted tokens, without the agent's pooled
// grants, to which no token is bound yet.
func (c *Cluster) ClaimedGrants(ctx context.Context, ns string) ([]corev1.Secret, error) {
	list, err := c.Client.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{LabelSelector: spokepkg.GrantLabelSelector})
	if err != nil {
		return nil, err
	}
	var claimed []corev1.Secret
	for _, g := range list.Items {
		if g.Annotations[spokepkg.GrantHubUserAnnotation] != "" {
			claimed = append(claimed, g)
		}
	}
	return claimed, nil
}

// BoundSecret returns the name of the Secret a spoke ServiceAccount token
// is bound to, from its kubernetes.io.secret.name claim, as the token's
// holder can read it.
func BoundSecret(tok string) (string, error) {
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return "", errors.New("the token is not a JWT")
	}
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return "", err
	}
	var c struct {
		Kubernetes struct {
			Secret struct {
				Name string `json:"name"`
			} `json:"secret"`
		} `json:"kubernetes.io"`
	}
	if err := json.Unmarshal(raw, &c); err != nil {
		return "", err
	}
	if c.Kubernetes.Secret.Name == "" {
		return "", errors.New("the token is bound to no Secret")
	}
	return c.Kubernetes.Secret.Name, nil
}
